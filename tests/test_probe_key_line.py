"""The key-line probe (issue #36, §5.2 on the reasoner's needle task): instances locate the key line and
the answer, each condition's deaths pin the key in exactly its heads, and the probe's ends are anchored
(R = 0 with the key gone everywhere, 1 with it kept everywhere). On the shipped reasoner: seconds."""

import pytest
import torch

from kvtier.deathtime import NEVER
from kvtier.evaluation.probes.key_line import (deaths_for_condition, format_key_line, head_orders,
                                               key_line_instances, pins_hold, run_key_line_probe)
from kvtier.models.reasoner import REASONER_DIR, build_reasoner_tokenizer
from kvtier.tasks import chains

SHIPPED = (REASONER_DIR / "model.safetensors").exists()


def test_instances_locate_the_key_line_the_question_and_the_answer():
    tok = build_reasoner_tokenizer()
    for inst, p in zip(key_line_instances(tok, "chains", 3), chains.eval_problems(3, "needle")):
        assert tok.decode(inst.ids[inst.key[0]:inst.key[1]]) == f"k={p.answer}\n"
        assert tok.decode(inst.ids[inst.question:inst.question + 2]) == "?k"
        assert tok.decode([inst.ids[j] for j in inst.answer]) == p.answer
        assert inst.prompt_len < inst.key[0] < inst.question < inst.answer[0]


def test_each_condition_keeps_the_key_in_exactly_its_heads_and_evicts_the_rest():
    tok = build_reasoner_tokenizer()
    inst = key_line_instances(tok, "chains", 1)[0]
    L, H, K, r = 4, 8, 256, 32
    orders = head_orders(inst, L, H)
    assert all(sorted(o) == list(range(H)) for o in orders) and len({tuple(o) for o in orders}) > 1
    a, b = inst.key
    for h in (0, 1, 3, 8):
        deaths, sites = deaths_for_condition(inst, h, L, H, K, r)
        assert sorted(sites) == sorted((l, hd) for l in range(L) for hd in orders[l][:h])   # nested: first h
        for l in range(L):
            for hd in range(H):
                d = deaths[l, hd, a:b]
                if (l, hd) in sites:
                    assert bool((d == NEVER).all()), (h, l, hd)
                else:
                    assert bool((d <= inst.question).all()), (h, l, hd, d)
        assert bool((deaths[:, :, :inst.prompt_len] == NEVER).all())          # the prompt is kept
        alive_at_end = (deaths == NEVER).sum(-1)
        assert int(alive_at_end.max()) <= K + 2 * r < len(inst.ids)           # random eviction bounded every head
    # the audit agrees with the explicit check above, and fails where the rounds do not reach the key: at a
    # budget beyond the trace nothing is evicted, so the key survives in the unchosen heads too
    deaths, sites = deaths_for_condition(inst, 3, L, H, K, r)
    assert pins_hold(deaths, inst, sites)
    deaths, sites = deaths_for_condition(inst, 3, L, H, 4096, r)
    assert not pins_hold(deaths, inst, sites)
    # one eviction seed per instance: every condition evicts the same entries until the key's first round
    d0, _ = deaths_for_condition(inst, 0, L, H, K, r)
    d8, _ = deaths_for_condition(inst, 8, L, H, K, r)
    before = d0 < int(d0[:, :, a:b].min())
    assert int(before.sum()) > 0 and bool((d8[before] == d0[before]).all())


@pytest.mark.skipif(not SHIPPED, reason="the shipped reasoner is not present")
def test_probe_on_the_shipped_reasoner_is_anchored_at_both_ends():
    from transformers import AutoModelForCausalLM

    from kvtier.deathtime import ATTN_NAME, register

    register()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(REASONER_DIR), dtype=torch.float32,
                                                 attn_implementation=ATTN_NAME).eval()
    res = run_key_line_probe(model, build_reasoner_tokenizer(), family="chains", n=3, budget=512, buffer=32,
                             n_boot=200)
    conds = {c["heads_keeping_key"]: c for c in res["conditions"]}
    assert sorted(conds) == [0, 1, 2] and res["num_kv_heads"] == 2 and res["pins_audited"] == 3 * 3
    # the key line carries the answer: deleting it everywhere costs log-prob against keeping it everywhere,
    # and full attention (the shipped model: 1.00 on needles) retrieves every one
    assert conds[2]["mean_lp"] > conds[0]["mean_lp"] + 1.0
    assert res["full_attention"]["retrieval"] == 1.0 and res["full_attention"]["mean_lp"] >= conds[2]["mean_lp"]
    assert "| 2 of 2 |" in format_key_line(res) and "full attention (no eviction)" in format_key_line(res)
    with pytest.raises(ValueError, match="within 0..2"):
        run_key_line_probe(model, build_reasoner_tokenizer(), family="chains", heads=[3], n=1)
    with pytest.raises(ValueError, match="K=2048"):                   # the rounds never reach the key
        run_key_line_probe(model, build_reasoner_tokenizer(), family="chains", n=1, budget=2048)


@pytest.mark.skipif(not SHIPPED, reason="the shipped reasoner is not present")
def test_probe_heads_command_as_documented(tmp_path):
    """`kvtier eval probe-heads` (docs/commands.md): writes key_line.json/.md/.png; bad settings are CLI errors."""
    import json

    from typer.testing import CliRunner

    from kvtier.cli import app

    res = CliRunner().invoke(app, ["eval", "probe-heads", "--n", "1", "--heads", "1", "--threads", "1",
                                   "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    out = json.loads((tmp_path / "key_line.json").read_text())["results"]["reasoner"]
    assert [c["heads_keeping_key"] for c in out["conditions"]] == [0, 1, 2] and (tmp_path / "key_line.png").exists()
    for args, word in ((["--heads", "5"], "within 0..2"), (["--budget", "2048"], "K=2048"),
                       (["--family", "nope"], "unknown task family")):
        res = CliRunner().invoke(app, ["eval", "probe-heads", "--n", "1", *args, "--out", str(tmp_path / "bad")])
        assert res.exit_code == 2 and word in res.output, res.output


def test_side_by_side_models_are_labelled_by_their_shortest_distinct_path(tmp_path):
    """The long recipe's models share a phase folder name (`train/long-2kv/p5`, `train/long-8kv/p5`): the probe
    labels them by the path suffix that tells them apart, and refuses the same model given twice."""
    from typer.testing import CliRunner

    from kvtier.cli import app
    from kvtier.evaluation.reasoner_cli import model_labels

    assert model_labels(["train/long-2kv/p5", "train/long-8kv/p5"]) == ["long-2kv/p5", "long-8kv/p5"]
    assert model_labels(["a/p5", "b/p4"]) == ["p5", "p4"]
    assert model_labels([str(REASONER_DIR)]) == ["reasoner"]
    res = CliRunner().invoke(app, ["eval", "probe-heads", "--model", "x/p5", "--model", "./x/p5",
                                   "--out", str(tmp_path)])
    assert res.exit_code == 2 and "the same model twice" in res.output, res.output
