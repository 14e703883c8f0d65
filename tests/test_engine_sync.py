"""Issue #25 item 3: a compacting step makes no host round trip on the path a GPU runs. On a GPU a tensor
built from a Python list on the device, or a device value read on the host (`.item()`, `bool()`,
`.tolist()`, `nonzero()`), waits for the forward in flight and loses async scheduling's overlap. The GPU
path (victim_selection.HOST_CHECK = False) is run here on CPU, every such call inside the worker's
`_compact` counted: zero, and the same tokens as the CPU path."""

import pytest
import torch

pytest.importorskip("vllm")

from engine_helpers import PROMPTS, greedy  # noqa: E402
from kvtier.engine import victim_selection  # noqa: E402
from kvtier.engine.api import build_llm  # noqa: E402

pytestmark = pytest.mark.engine

FORBIDDEN = ("item", "tolist", "nonzero", "cpu", "__bool__", "__int__", "__float__")


class HostReads:
    """Counts host reads of tensor values and device tensors built from lists while active."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        self.active = False
        for name in FORBIDDEN:
            orig = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, orig))
        orig_tensor = torch.tensor

        def tensor(data, *args, **kwargs):
            if self.active and kwargs.get("device") is not None and isinstance(data, (list, tuple)):
                self.calls.append("torch.tensor(list, device=...)")
            return orig_tensor(data, *args, **kwargs)

        monkeypatch.setattr(torch, "tensor", tensor)

    def _wrap(self, name, orig):
        def counted(t, *args, **kwargs):
            if self.active:
                self.calls.append(f"Tensor.{name}")
            return orig(t, *args, **kwargs)
        return counted


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return build_llm(tiny_model_dir, eviction={"default": {"buffer": 16}}, kv_cache_bytes=16 << 20,
                     max_model_len=1024, max_num_seqs=8, enforce_eager=True)


def _generate(llm):
    params = [greedy(180, budget=80, seed=s) for s in (1, 2, 3)]
    return [o.outputs[0].token_ids for o in llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[0] + " x"], params,
                                                          use_tqdm=False)]


def test_a_compacting_step_reads_nothing_back_on_the_gpu_path(llm, monkeypatch):
    reference = _generate(llm)                                   # the CPU path (host check on)
    ev = llm.collective_rpc(lambda worker: worker.model_runner.kvtier)[0]
    reads = HostReads(monkeypatch)
    steps = []
    compact = ev._compact

    def counted(ops):
        reads.active = True
        try:
            compact(ops)
        finally:
            reads.active = False
        steps.append(len(ops))

    monkeypatch.setattr(ev, "_compact", counted)
    monkeypatch.setattr(victim_selection, "HOST_CHECK", False)
    got = _generate(llm)
    assert len(steps) >= 5 and sum(steps) >= 15, steps        # rounds of all three requests ran
    assert reads.calls == [], sorted(set(reads.calls))
    assert got == reference                                      # the same keep-sets, so the same tokens


def test_short_draws_are_flagged_for_a_later_host_read():
    """Without the host check a short draw is not repaired but reported (the deferred check's input)."""
    from kvtier.policies.keyed_random import keyed_subsets

    keys = torch.arange(6, dtype=torch.long)
    low, high = torch.zeros(6, dtype=torch.long), torch.full((6,), 40, dtype=torch.long)
    shorts: list = []
    out = keyed_subsets(keys, low, high, 8, 40, host_check=False, short_out=shorts)
    assert torch.equal(out, keyed_subsets(keys, low, high, 8, 40, host_check=True))
    assert len(shorts) == 1 and shorts[0].shape == (6,) and not shorts[0].any()
