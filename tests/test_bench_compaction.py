"""`kvtier bench compaction` at tiny shapes: every cell exact, the JSON complete, and the exactness check
able to fail (no timings asserted)."""

import json

import pytest
import torch

from kvtier.benchmarks.compaction import (Cell, CompactionShapes, batched_step, cell_memory, check_step, cpu_vec_write,
                                          layout_writer, make_policy, run_compaction_bench)
from kvtier.engine.layout import probe_layout

TINY = CompactionShapes(layers=2, kv_heads=2, head_dim=16, block_size=16, buffer=8, query_heads=4, prompt_len=8)
CPU = torch.device("cpu")


def test_every_cell_exact_and_json_complete():
    r = run_compaction_bench(device="cpu", requests=[3], budgets=[32], shapes=TINY, layouts=["flash", "cpu"],
                             policies=["random", "snapkv"], repeats=2, cpu_writer="emulated")
    json.dumps(r)
    assert r["torch"] == torch.__version__ and r["device"].startswith("cpu")
    assert r["layouts"]["flash"]["chunk"] == 16                  # whole head_dim rows
    assert r["layouts"]["cpu"]["chunk"] == 1                     # K stored transposed: one-element rows
    assert r["targets"] == {"random_ratio_to_floor_max": 0.25, "h200_ms_per_request_at_2048_max": 0.5}
    assert r["skipped"] == [] and len(r["cells"]) == 2
    for c in r["cells"]:
        assert {c["layout"], c["budget"], c["requests"]} <= {"flash", "cpu", 32, 3}
        assert c["floor_ms_per_step"] > 0 and c["floor_exact"] is True
        assert set(c["policies"]) == {"random", "snapkv"}
        for p in c["policies"].values():
            assert p["exact"] is True
            assert p["ms_per_step"] > 0 and p["ms_per_request"] > 0 and p["ratio_to_floor"] > 0
    assert r["summary"]["all_exact"] is True and "random_ratio_to_floor_max" in r["summary"]


def test_oversized_cells_are_skipped_with_a_reason():
    one = cell_memory(1, 32, TINY, torch.bfloat16, 16, "clone")["total"]
    r = run_compaction_bench(device="cpu", requests=[1, 3], budgets=[32], shapes=TINY, layouts=["flash"],
                             policies=["random"], repeats=1, max_gb=1.5 * one / 2**30)
    assert [c["requests"] for c in r["cells"]] == [1]
    assert r["skipped"][0]["requests"] == 3 and "GiB" in r["skipped"][0]["reason"]


@pytest.mark.parametrize("layout", ["flash", "cpu"])
@pytest.mark.parametrize("pristine", ["clone", "regenerate"])
def test_exactness_check_catches_a_corrupted_row_and_slot_map(layout, pristine):
    cell = Cell(layout_writer(layout, TINY, CPU, torch.bfloat16, cpu_writer="emulated"), 32, 3, TINY,
                device=CPU, pristine=pristine)
    policy = make_policy("random")
    cell.restore()
    pos = cell.rearm()
    before = [p.clone() for p in pos]
    evicted = batched_step(cell, "random", policy, pos)
    assert check_step(cell, before, evicted, cell.state)
    # one kept element of request 1, layer 1, head 0, slot 5 (its K's first run) changes
    rows, view = cell.rows, cell.row_views[1]
    blocks = cell.blocks[1]
    idx = rows.token_rows(blocks[5 // 16].view(1), torch.tensor([0]), torch.tensor([5 % 16]))[0, 0]
    saved = view[idx].clone()
    view[idx] += 1
    assert not check_step(cell, before, evicted, cell.state)
    view[idx] = saved
    assert check_step(cell, before, evicted, cell.state)
    # a slot map that names the wrong slot for two kept positions
    bad = [s.clone() for s in cell.state]
    bad[2][0, 1, [3, 20]] = bad[2][0, 1, [20, 3]]
    assert not check_step(cell, before, evicted, bad)


def test_cpu_emulation_is_vllms_own_layout():
    pytest.importorskip("vllm")
    from kvtier.benchmarks.compaction import vllm_cpu_writer

    s = CompactionShapes(layers=1, kv_heads=2, head_dim=32, block_size=16)   # smallest head_dim its kernels take
    write, isa = vllm_cpu_writer(s, torch.bfloat16)
    cache = torch.empty(5, 2, 16, 64, dtype=torch.bfloat16)
    real = probe_layout(cache, 5, 2, 16, 32, write)
    emul = probe_layout(cache, 5, 2, 16, 32, cpu_vec_write)
    assert isa in ("vec", "vec16", "amx")
    if isa != "amx":     # AMX tiles differ; the engine probes whatever the backend writes
        assert torch.equal(real.k_offsets, emul.k_offsets) and torch.equal(real.v_offsets, emul.v_offsets)


def test_gpu_launcher_runs_without_vllm_or_an_installed_kvtier(tmp_path):
    """`PYTHONPATH=src python -m kvtier.benchmarks.gpu_compaction` on a python where `vllm` (nor pydantic, typer,
    Ray) does not import and kvtier is not installed (the GPU machine): kvtier comes from the checkout's src/."""
    from bare_torch import run_on_bare_torch

    out = tmp_path / "c.json"
    proc = run_on_bare_torch("kvtier.benchmarks.gpu_compaction", ["--tiny", "--device", "cpu", "--repeats", "1",
                                                                 "--policies", "random", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["summary"]["all_exact"] is True and len(r["cells"]) == 2
    assert r["layouts"]["cpu"]["writer"] == "emulated"
