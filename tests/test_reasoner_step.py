"""A reasoner step's group a row at a time (reasoner_step.py) computes the gradient the padded batch does:
under transformers' loss, under the weighted loss, and under simulated eviction with full-attention rows
among evicted ones."""

from __future__ import annotations

import pytest
import torch

from kvtier.models.reasoner_data import token_weights
from kvtier.models.reasoner_step import SPLIT_FROM, backward_group, rows, splits_rows
from kvtier.deathtime.record import NEVER
from kvtier.models.train_eviction import EvictMix, row_spans

LENGTHS, PROMPT = (90, 61, 120, 75), 9


def _model(attn: str):
    from transformers import Qwen3ForCausalLM

    from kvtier.models.reasoner import reasoner_config

    torch.manual_seed(0)
    cfg = reasoner_config("long-8kv")
    cfg.num_hidden_layers = 2
    cfg._attn_implementation = attn
    return Qwen3ForCausalLM(cfg)


def _batch():
    g = torch.Generator().manual_seed(1)
    T = max(LENGTHS)
    ids = torch.zeros(len(LENGTHS), T, dtype=torch.long)
    labels = torch.full((len(LENGTHS), T), -100)
    for i, n in enumerate(LENGTHS):
        ids[i, :n] = torch.randint(3, 32, (n,), generator=g)
        labels[i, PROMPT:n] = ids[i, PROMPT:n]
    return ids, labels


def _grads(model, split: bool, **kw) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    value = backward_group(model, split=split, bf16=False, **kw)
    return [value] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("case", ["hf_loss", "weighted", "evicted"])
def test_a_row_at_a_time_gives_the_padded_batchs_gradient(case):
    from kvtier.deathtime import register

    ids, labels = _batch()
    plan = [(None, 0)] * len(LENGTHS)
    extra = {}
    if case == "evicted":
        plan = [(16, 5), (None, 0), (24, 7), (16, 9)]     # full attention beside evicted rows
        prompt_lens, lengths = row_spans(labels)
        extra = {"kvtier_deaths": EvictMix("random", (16, 24), 4).deaths(prompt_lens, lengths, ids.shape[1], plan,
                                                                           2, 8)}
        assert (extra["kvtier_deaths"][0] < NEVER).any()    # some entry dies: eviction is in the forward
    model = _model(register() if case == "evicted" else "sdpa")
    w = token_weights(labels, 1.0 if case == "hf_loss" else 20.0)
    kw = dict(ids=ids, labels=labels, w=w, extra=extra, plan=plan, total=float(w.sum()) * 1.5,
              hf_loss=case == "hf_loss")
    whole, split = _grads(model, False, **kw), _grads(model, True, **kw)
    assert split[0] == pytest.approx(whole[0], rel=1e-5)
    for a, b in zip(whole[1:], split[1:]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)


def test_rows_are_cut_to_their_length_and_full_rows_drop_the_deaths():
    ids, labels = _batch()
    w = token_weights(labels, 1.0)
    deaths = torch.zeros(len(LENGTHS), 2, 8, ids.shape[1], dtype=torch.long)
    out = rows(ids, labels, w, {"kvtier_deaths": deaths}, [(16, 1), (None, 0), (16, 2), (None, 0)])
    assert [r[0].shape[1] for r in out] == list(LENGTHS)
    assert [r[2].shape[1] for r in out] == [n - 1 for n in LENGTHS]
    assert [sorted(r[3]) for r in out] == [["kvtier_deaths"], [], ["kvtier_deaths"], []]
    assert out[2][3]["kvtier_deaths"].shape == (1, 2, 8, LENGTHS[2])


def test_only_wide_groups_on_a_cpu_split():
    assert splits_rows("cpu", SPLIT_FROM) and not splits_rows("cpu", SPLIT_FROM - 1)
    assert not splits_rows("cuda", 4 * SPLIT_FROM) and not splits_rows("cuda:1", SPLIT_FROM)
