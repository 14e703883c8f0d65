"""Training under `random_line_reserve` (train_eviction.py, issue #63 item 2): the mix parses at the policy's
defaults, its records are simulated from the trained weights' first-layer keys, a needle's answer is trained
exactly when its key line is whole in every (layer, head) row to the last query, and one step runs with both.

CPU, the base reasoner shape (4 layers, 2 KV heads) at random init; `_line_model` makes its first-layer keys
single out the key line (`k` and `=` get their own embedding, every other token nearly one), as the trained
long reasoner's do (docs/reasoner.md), so the policy keeps that line."""

import types

import pytest
import torch

from kvtier.deathtime import NEVER, first_layer_keys, simulate_deaths
from kvtier.models.reasoner import build_reasoner_tokenizer, reasoner_config
from kvtier.models.reasoner_data import key_line_span, make_batch, short_problems, step_problems
from kvtier.models.train_eviction import (DeathsAhead, EvictMix, answer_untrained, deaths_for, key_line_kept,
                                          row_spans, unanswerable)
from kvtier.policies import EvictionSchedule, make_policy
from kvtier.tasks import chains as rt

MIX = "random_line_reserve:128,256:32"


@pytest.fixture(scope="module")
def tok():
    return build_reasoner_tokenizer()


def _line_model(tok):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(reasoner_config())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.copy_(emb[5] + 0.002 * torch.randn(emb.shape, generator=g))
        for c in "k=":
            emb[tok.convert_tokens_to_ids(c)] = 0.02 * torch.randn(emb.shape[1], generator=g)
    return model


def test_the_mix_parses_at_the_policys_defaults():
    mix = EvictMix.parse("random_line_reserve:256,512,1024:32", 0.25)
    assert (mix.policy, mix.budgets, mix.buffer, mix.full_share) == ("random_line_reserve", (256, 512, 1024), 32, 0.25)
    assert mix.reads_keys and not EvictMix.parse("random:256:32").reads_keys
    assert make_policy(mix.policy).params() == {"protect_prompt": True, "sinks": 0, "reserve": 0.1, "span": 5}
    assert mix.describe() == "random_line_reserve:256,512,1024:32"
    for other in ("snapkv:128", "random_reserve:128"):                    # they read more than first-layer keys
        with pytest.raises(ValueError, match="reads the cache"):
            EvictMix.parse(other)
    with pytest.raises(ValueError, match="--workers 0"):                  # records need the step's own weights
        DeathsAhead(mix, reasoner_config(), lambda s: [], workers=1)


def test_the_key_line_span_is_the_key_line(tok):
    """`k=NN` and its newline, NN the needle's answer, in make_batch's rows; none in a chain without one."""
    for family in ("chains", "chains-long"):
        probs = step_problems(3, 0, 4, set(), family)
        ids, _ = make_batch(tok, probs, tok.pad_token_id)
        for i, p in enumerate(probs):
            a, b = key_line_span(tok, p)
            assert tok.decode(ids[i, a:b]) == f"k={rt.show(p.key)}\n"
            if p.kind == "needle":
                assert rt.show(p.key) == p.answer
    assert all(key_line_span(tok, p) is None for p in short_problems(3, 0, 4))       # n <= 40 < key_at


def test_a_needle_answer_is_trained_only_with_its_key_line_whole_in_every_row():
    """Visible to query i iff i < death: the line must outlive the last weighted query (length - 2)."""
    probs = [types.SimpleNamespace(kind=k) for k in ("needle", "needle", "local")]
    plan, spans, lengths = [(128, 1), (None, 0), (128, 2)], [(50, 55), (50, 55), None], [100, 100, 100]
    deaths = torch.full((3, 2, 2, 100), NEVER, dtype=torch.int32)
    assert unanswerable(probs, plan) == [True, False, False]                # no records: every evicted needle
    assert unanswerable(probs, plan, deaths, spans, lengths) == [False, False, False]
    deaths[0, 1, 0, 54] = 99                                                 # gone only after the last query
    assert key_line_kept(deaths[0], (50, 55), 100)
    assert unanswerable(probs, plan, deaths, spans, lengths) == [False, False, False]
    deaths[0, 1, 0, 54] = 98                                                 # one token, one row, at the last query
    assert unanswerable(probs, plan, deaths, spans, lengths) == [True, False, False]


def test_records_come_from_the_current_weights_keys(tok):
    """deaths_for computes the batch's first-layer keys from the model it is given and simulates each evicted
    row from its own keys and seed; with keys singling out the key line, the policy keeps it and the needles'
    answers are trained, which random's records do not allow."""
    model = _line_model(tok)
    probs = step_problems(7, 3, 4, set())
    ids, labels = make_batch(tok, probs, tok.pad_token_id)
    mix, plan = EvictMix.parse(MIX, 0.0), [(128, 5), (256, 6), (None, 0), (128, 8)]
    got = deaths_for(mix, plan, labels, model, ids)
    keys = first_layer_keys(model, ids)
    for i, ((k, seed), p, n) in enumerate(zip(plan, *row_spans(labels))):
        if k is None:
            assert (got["kvtier_deaths"][i] == NEVER).all()
            continue
        want = simulate_deaths(make_policy(mix.policy), EvictionSchedule(k, 32), p, n, num_layers=4, num_kv_heads=2,
                               seed=seed, first_keys=keys[i])
        assert torch.equal(got["kvtier_deaths"][i, ..., :n], want)
    assert [p.kind for p in probs] == ["local", "needle", "local", "needle"]
    assert answer_untrained(tok, probs, plan, labels, got) == [False] * 4
    ran = deaths_for(EvictMix.parse("random:128,256:32", 0.0), plan, labels, model)
    assert answer_untrained(tok, probs, plan, labels, ran) == [False, True, False, True]
    with pytest.raises(ValueError, match="ids"):
        deaths_for(mix, plan, labels, model)


def test_one_training_step_under_the_policy(tok, tmp_path, monkeypatch):
    """`--evict random_line_reserve:...` trains: the step's records are simulated from the keys (a needle
    under eviction, its line kept, is trained), and the end-of-phase checks run under the policy."""
    from kvtier.models import reasoner_train
    from kvtier.models.reasoner_save import save_model
    from kvtier.models.train_config import TrainConfig

    save_model(_line_model(tok), tok, tmp_path / "init")
    seen = []

    def spy(tok_, probs, plan, labels, extra):
        out = answer_untrained(tok_, probs, plan, labels, extra)
        seen.extend((p.kind, k, "kvtier_deaths" in extra, u) for p, (k, _), u in zip(probs, plan, out))
        return out

    monkeypatch.setattr(reasoner_train, "answer_untrained", spy)
    cfg = TrainConfig(steps=1, batch=2, threads=1, held_out=1, warmup=1, dtype="float32", answer_weight=20.0,
                      init_from=str(tmp_path / "init"), evict=MIX, full_share=0.0)
    rec = reasoner_train.train(cfg, tmp_path / "out", log=lambda s: None)
    assert "--evict random_line_reserve:128,256:32 --full-share 0.0" in rec["command"]
    assert set(rec["held_out_teacher_forced"]) >= {"local_random_line_reserve_K128", "local_random_line_reserve_K256"}
    assert seen and all(k is not None and has_deaths for _, k, has_deaths, _ in seen)     # full_share 0: all evicted
    assert any(kind == "needle" and not untrained for kind, _, _, untrained in seen)       # its line kept: trained


def test_the_documented_fine_tune_is_reasoner_longs_with_only_the_policy_changed():
    import json
    from pathlib import Path

    from kvtier.models.reasoner import REASONER_LONG_DIR

    shipped = json.loads((REASONER_LONG_DIR / "TRAINING.json").read_text())["command"]
    doc = (Path(__file__).resolve().parents[1] / "docs" / "reasoner.md").read_text()
    want = shipped.replace("--evict random:", "--evict random_line_reserve:") + " --out train/long-8kv/evict-line"
    assert want != shipped + " --out train/long-8kv/evict-line" and want in doc
    EvictMix.parse(want.split("--evict ")[1].split()[0])
