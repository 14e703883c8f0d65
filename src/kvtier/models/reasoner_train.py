"""Train the shipped reasoner (``kvtier model train-reasoner``): deterministic on a CPU, resumable on any device.

Data (reasoner_data.py): every step draws ``batch`` fresh problems (half local chains, half needles) of the
task family ``family`` (kvtier.tasks.chains) from the step's own seed, skipping the held-out problems; the
loss is next-token cross-entropy on the trace and eos only. With ``evict`` each sample is trained under a
simulated eviction replayed as death-time attention (train_eviction.py: which mix, why). Same seed, steps,
thread count and precision (the resolved ``dtype``) on a CPU: same weights (no dropout; data depends on the
step only, so a resumed run equals an uninterrupted one). ``device`` cuda trains on a GPU (its sums differ
from a CPU's in the last bits); a checkpoint resumes on either, and TRAINING.json's ``devices`` says which
steps ran where.

Output (``out``, default ``src/kvtier/models/reasoner``): the Hugging Face files (reasoner_save.py), and
``TRAINING.json``: command parameters, data seed, steps, the
safetensors' sha256, the loss curve (every ``log_every`` steps), held-out teacher-forced token accuracy
per kind, wall time. ``out/ckpt.pt`` (fp32 weights + optimizer, every ``ckpt_every`` steps, and at once
on SIGTERM/SIGINT, which pause the run) lets the same command resume it; it is deleted when training
finishes. Speed on the AVX-512-bf16 CPU the shipped model was trained on (batch 8): 1.4 s per step with 2
threads and bf16 autocast, 2.1 s (1 thread, bf16), 2.1 s (2 threads, fp32), 3.1 s (1 thread, fp32).

Precision (``dtype``): train_config.py.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from kvtier.engine import cpu_dtype
from kvtier.tasks import chains as rt

from .reasoner import REASONER_DIR, build_reasoner_tokenizer, reasoner_config
from .reasoner_data import held_out_keys, longest_sequence, make_batch, short_problems, step_problems, token_weights
from .reasoner_save import save_model
from .reasoner_step import SPLIT_FROM, backward_group, splits_rows
from .train_config import ATTENTION, RUN_ONLY, TrainConfig, lr_at, resolve_dtype, saved_config
from .train_eviction import EvictMix, answer_untrained, deaths_for


def teacher_forced_accuracy(model, tok, problems, mix: EvictMix | None = None, budget: int | None = None) -> dict:
    """Token accuracy of argmax predictions on the trace and the fraction of whole traces all correct;
    with `mix` and `budget`, under that policy's simulated eviction at K = budget (eviction seed = index)."""
    import torch

    ids, labels = make_batch(tok, problems, tok.pad_token_id)
    extra = deaths_for(mix, [(budget, i) for i in range(len(problems))], labels, model, ids) if budget else {}
    dev = model.device
    with torch.no_grad():
        pred = model(input_ids=ids.to(dev), **_on(extra, dev)).logits[:, :-1].argmax(-1).cpu()
    tgt = labels[:, 1:]
    mask = tgt != -100
    ok = (pred == tgt) | ~mask
    return {"token_accuracy": float(((pred == tgt) & mask).sum() / mask.sum()),
            "trace_exact": float(ok.all(dim=1).float().mean())}


def _on(extra: dict, device) -> dict:
    return {k: v.to(device) for k, v in extra.items()}


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        dev = torch.device(device)
        index = torch.cuda.current_device() if dev.index is None else dev.index
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return f"cpu ({cpu_dtype.cpu_model() or 'unknown'})"


class _StopOnSignal:
    """SIGTERM/SIGINT set a flag the training loop checks between steps (main thread only)."""

    def __init__(self):
        import signal
        import threading

        self.requested = False
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._set)

    def _set(self, *_):
        self.requested = True

    def restore(self) -> None:
        import signal

        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def previous_record(model_dir: Path) -> dict:
    """What a continued phase nests: the model's TRAINING.json (a finished phase, loss curve included), else its
    EXPORT.json (a checkpoint taken mid-phase: `kvtier model export-checkpoint`), else where it came from."""
    if (model_dir / "TRAINING.json").exists():
        return json.loads((model_dir / "TRAINING.json").read_text())
    if (model_dir / "EXPORT.json").exists():
        return {"exported_checkpoint": json.loads((model_dir / "EXPORT.json").read_text())}
    return {"model_dir": str(model_dir), "record": None}


def train(cfg: TrainConfig, out: Path = REASONER_DIR, log=print) -> dict:
    """Train (or resume from out/ckpt.pt) and write the model directory; returns TRAINING.json's dict, or
    {"paused_at": step} when a SIGTERM/SIGINT paused it (out/ckpt.pt then holds the state)."""
    import torch
    from transformers import Qwen3ForCausalLM

    fam = rt.family(cfg.family)
    dtype, dtype_reason = resolve_dtype(cfg.dtype, cfg.device)
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {cfg.device!r}: torch sees no CUDA device here (--device cpu)")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_reasoner_tokenizer()
    mix = EvictMix.parse(cfg.evict, cfg.full_share)
    attn = "sdpa"
    if mix is not None:            # death-time attention; plain SDPA for forwards without deaths
        from kvtier.deathtime import register

        attn = register()
        if cfg.attention != "auto":           # the same attention either way; mask is SDPA's tested path, flex spares memory
            from kvtier.deathtime import attention as deathtime_attention

            if cfg.attention not in ATTENTION:
                raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {cfg.attention!r}")
            deathtime_attention.BACKEND[torch.device(cfg.device).type] = cfg.attention
    if cfg.init_from:
        previous = previous_record(Path(cfg.init_from))   # read now: a missing record must not end a long phase
        model = Qwen3ForCausalLM.from_pretrained(cfg.init_from, dtype=torch.float32, attn_implementation=attn)
    else:
        mcfg = reasoner_config(cfg.shape)
        mcfg._attn_implementation = attn
        model = Qwen3ForCausalLM(mcfg)
    model.to(cfg.device)
    positions = model.config.max_position_embeddings
    tok.model_max_length = positions
    if longest_sequence(fam) > positions:
        raise ValueError(f"task family {fam.name} has sequences of up to {longest_sequence(fam)} tokens; the model "
                         f"has max_position_embeddings {positions} (--shape {cfg.shape}; SHAPES in "
                         f"src/kvtier/models/reasoner.py{', or --init-from' if cfg.init_from else ''}): train a "
                         "shape with more positions (long-2kv, long-8kv)")
    log(f"dtype {dtype} ({dtype_reason})")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    exclude = held_out_keys(family=fam.name)
    if cfg.aux_batch:                                 # the other family's evaluation problems stay unseen too
        rt.family(cfg.aux_family)
        aux_exclude = held_out_keys(family=cfg.aux_family)
    start, history, elapsed = 0, [], 0.0
    ckpt = out / "ckpt.pt"
    run_cfg = {k: v for k, v in asdict(cfg).items() if k not in RUN_ONLY}
    run_cfg["dtype"] = dtype                          # what the weights depend on: the resolved dtype
    devices = []
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False, map_location="cpu")   # load_state_dict places it
        saved = saved_config(state["config"])
        # Only `steps` may differ, and only while still in warmup (the schedules agree up to there).
        same = {**saved, "steps": cfg.steps} == run_cfg and state["step"] <= cfg.warmup
        if saved != run_cfg and not same:
            raise ValueError(f"{ckpt} was written with {saved}, not {run_cfg}; delete it to restart (or pass "
                             f"the --dtype it was written with)")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, history, elapsed = state["step"], state["history"], state["elapsed"]
        window = state.get("window", [])
        devices = state.get("devices") or [{"from_step": 0, "device": "cpu (before devices were recorded)"}]
        log(f"resumed at step {start}")
    else:
        window = []
    here = _device_name(cfg.device)
    if splits_rows(cfg.device, longest_sequence(fam)):    # a change of how steps run, recorded like a device's
        here += f" (groups of {SPLIT_FROM}+ tokens a row at a time: reasoner_step.py)"
    if not devices or devices[-1]["device"] != here:
        if devices:
            log(f"resuming on {here}; steps before {start} ran on {devices[-1]['device']} (TRAINING.json records both)")
        devices.append({"from_step": start, "device": here})
    t0 = time.time() - elapsed
    stop = _StopOnSignal()

    def save(step: int) -> None:
        tmp = ckpt.with_suffix(".tmp")             # a kill mid-write leaves the last checkpoint whole
        torch.save({"config": run_cfg, "model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "history": history, "window": window, "elapsed": time.time() - t0, "devices": devices}, tmp)
        os.replace(tmp, ckpt)

    @functools.lru_cache(maxsize=64)   # DeathsAhead reads a step's data ahead of the step: built once
    def step_data(step: int):
        """[(problems, (ids, labels), plan)] per group of `step`: a function of the step alone."""
        groups = [step_problems(cfg.seed, step, cfg.batch, exclude, fam.name)]
        if cfg.short_batch:
            groups.append(short_problems(cfg.seed, step, cfg.short_batch, fam.name))
        if cfg.aux_batch:
            groups.append(step_problems(cfg.seed, step, cfg.aux_batch, aux_exclude, cfg.aux_family, "/aux"))
        return [(g, make_batch(tok, g, tok.pad_token_id),
                 mix.assign(cfg.seed, step, str(i), len(g)) if mix else [(None, 0)] * len(g))
                for i, g in enumerate(groups)]

    ahead = None
    if mix is not None and cfg.workers > 0:
        from .train_eviction import DeathsAhead

        ahead = DeathsAhead(mix, model.config, lambda s: [(plan, b[1]) for _, b, plan in step_data(s)], cfg.workers,
                            log=log)

    model.train()
    step_seconds = []
    for step in range(start, cfg.steps):
        if stop.requested:                    # SIGTERM/SIGINT: pause (resume with the same command)
            if ahead is not None:
                ahead.close()
            save(step)
            stop.restore()
            log(f"paused at step {step}: {ckpt}")
            return {"paused_at": step}
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        step_t0 = time.time()
        data = step_data(step)
        groups, batches, plans = ([d[i] for d in data] for i in range(3))
        # every group's deaths before any weight: a needle's answer weight depends on them (answer_untrained)
        extras = [ahead.get(step, g, cfg.steps) if ahead is not None else deaths_for(mix, plan, labels, model, ids)
                  for g, ((ids, labels), plan) in enumerate(zip(batches, plans))]
        weights = [token_weights(labels, cfg.answer_weight, answer_untrained(tok, probs, plan, labels, extra))
                   for (_, labels), probs, plan, extra in zip(batches, groups, plans, extras)]
        total = sum(float(w.sum()) for w in weights)
        loss_value = 0.0
        for (ids, labels), w, plan, extra in zip(batches, weights, plans, extras):   # one weighted mean over every group's trace tokens
            ids, labels, w, extra = ids.to(cfg.device), labels.to(cfg.device), w.to(cfg.device), _on(extra, cfg.device)
            loss_value += backward_group(model, ids, labels, w, extra, plan, total, bf16=dtype == "bfloat16",
                                         hf_loss=cfg.answer_weight == 1.0 and mix is None,   # how phases 1-2 ran
                                         split=splits_rows(cfg.device, ids.shape[1]))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_seconds.append(time.time() - step_t0)
        window.append(loss_value)
        if (step + 1) % cfg.log_every == 0:
            history.append({"step": step + 1, "loss": sum(window) / len(window), "seconds": round(time.time() - t0, 1)})
            window = []
            if (step + 1) % cfg.eval_every == 0:
                model.eval()
                local = fam.eval_problems(cfg.held_out, "local")
                history[-1]["held_out_local"] = teacher_forced_accuracy(model, tok, local)
                for k in (mix.budgets if mix else ()):
                    history[-1][f"held_out_local_{mix.policy}_K{k}"] = teacher_forced_accuracy(model, tok, local, mix, k)
                model.train()
            log(json.dumps(history[-1]))
        if (step + 1) % cfg.ckpt_every == 0 and step + 1 < cfg.steps:
            save(step + 1)
    # The handler stays until TRAINING.json is written: a pause asked for from here on lets the phase finish
    # and is reported (`stop_requested`) so a recipe starts no further phase.
    if ahead is not None:
        ahead.close()
    # Training steps this invocation ran (data, forward, backward, optimizer; not the periodic held-out
    # checks or checkpoints): what `--steps 24 --dtype float32` against `--dtype bfloat16` compares.
    busy = sum(step_seconds)
    speed = {"steps": len(step_seconds), "seconds": round(busy, 2),
             "steps_per_second": round(len(step_seconds) / busy, 4) if busy else None,
             "seconds_per_step_median": round(sorted(step_seconds)[len(step_seconds) // 2], 3) if step_seconds else None,
             "dtype": dtype, "threads": cfg.threads, "batch": cfg.batch, "short_batch": cfg.short_batch,
             "aux_batch": cfg.aux_batch, "family": fam.name, "evict": cfg.evict, "device": here, "workers": cfg.workers}
    log(f"speed: {speed['steps']} steps in {busy:.1f} s = {speed['steps_per_second']} steps/s (median "
        f"{speed['seconds_per_step_median']} s per step; {dtype}, {cfg.threads} threads, batch {cfg.batch})")
    wall = time.time() - t0
    model.eval()
    held = {k: teacher_forced_accuracy(model, tok, fam.eval_problems(cfg.held_out, k)) for k in rt.KINDS}
    for k in (mix.budgets if mix else ()):
        held[f"local_{mix.policy}_K{k}"] = teacher_forced_accuracy(model, tok, fam.eval_problems(cfg.held_out, "local"), mix, k)
    sha = save_model(model, tok, out)
    n_params = sum(p.numel() for n, p in model.named_parameters() if n != "lm_head.weight")
    record = {"command": f"kvtier model train-reasoner --steps {cfg.steps} --seed {cfg.seed} --batch {cfg.batch} "
                         f"--lr {cfg.lr} --warmup {cfg.warmup} --threads {cfg.threads} --dtype {dtype}"
                         + (f" --family {fam.name}" if fam.name != rt.DEFAULT_FAMILY else "")
                         + (f" --init-from {cfg.init_from} --short-batch {cfg.short_batch}" if cfg.init_from else "")
                         + (f" --answer-weight {cfg.answer_weight}" if cfg.answer_weight != 1.0 else "")
                         + (f" --aux-family {cfg.aux_family} --aux-batch {cfg.aux_batch}" if cfg.aux_batch else "")
                         + (f" --evict {mix.describe()} --full-share {cfg.full_share}" if mix else ""),
              "config": asdict(cfg), "data_seed": cfg.seed, "steps": cfg.steps, "sequences": cfg.steps * cfg.batch,
              "parameters": n_params, "model_safetensors_sha256": sha,
              "safetensors_bytes": (out / "model.safetensors").stat().st_size,
              "loss_first": history[0]["loss"] if history else None,
              "loss_last": history[-1]["loss"] if history else None, "loss_curve": history,
              "held_out_teacher_forced": held, "wall_seconds": round(wall, 1),
              "dtype": {"requested": cfg.dtype, "resolved": dtype, "reason": dtype_reason}, "speed": speed,
              "family": fam.name, "torch": torch.__version__, "eval_seed": rt.EVAL_SEED, "devices": devices}
    if cfg.init_from:
        record["previous_phase"] = previous
    tmp = out / "TRAINING.json.tmp"                # TRAINING.json marks a finished phase: written whole or not at all
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, out / "TRAINING.json")
    ckpt.unlink(missing_ok=True)
    stop.restore()
    return {**record, "stop_requested": True} if stop.requested else record
