"""`make serve`'s per-tier numbers come from the committed goodput results, not from the code: the banner
lines and the service README's table are rendered from results/goodput-*.json (tier_report.py)."""

import json
from pathlib import Path

from kvtier.service.config import load_config
from kvtier.service.tier_report import BEGIN, DEMO_CONFIG, END, markdown, render_into, tier_lines

ROOT = Path(__file__).resolve().parents[1]


def _result(model_id, arms):
    return {"settings": {"model_id": model_id}, "runs": [arms], "arms": arms}


def test_lines_come_from_the_newest_result_for_the_model(tmp_path):
    cfg = load_config(DEMO_CONFIG)
    model = cfg.model_ids[0]
    arm = lambda acc, cps, stock: {"accuracy": {"local": acc, "needle": acc / 2}, "correct_per_s": cps,  # noqa: E731
                                   "correct_per_s_ratio_to_stock": stock}
    (tmp_path / "goodput-cpu-2026-01-01.json").write_text(json.dumps(_result(model, {"full": arm(1.0, 1.0, 1.0)})))
    (tmp_path / "goodput-cpu-2026-02-01.json").write_text(json.dumps(_result(model, {
        "full": arm(1.0, 2.0, 1.0), "k256": arm(0.9, 3.0, 1.5)})))
    (tmp_path / "goodput-cpu-2026-03-01.json").write_text(json.dumps(_result("another-model", {"full": arm(0.1, 9.0, 1.0)})))
    lines = tier_lines(cfg, tmp_path)
    assert set(lines) == {"full", "k256"}
    assert "accuracy local 0.90, needle 0.45, 1.50x full attention's correct answers/s (1.50x stock vLLM)" in lines["k256"]
    assert "goodput-cpu-2026-02-01.json" in lines["k256"]
    table = markdown(cfg, tmp_path)
    assert "| `k512` | K=512 r=32 random | not measured |" in table and "| `auto` |" in table


def test_the_service_readme_table_is_rendered_from_the_committed_results(tmp_path):
    readme = ROOT / "src" / "kvtier" / "service" / "README.md"
    copy = tmp_path / "README.md"
    copy.write_text(readme.read_text())
    assert not render_into(copy), "run: python -m kvtier.service.tier_report src/kvtier/service/README.md"
    block = readme.read_text().split(BEGIN, 1)[1].split(END, 1)[0]
    assert block.strip() == markdown(load_config(DEMO_CONFIG)).strip()


def test_a_load_sweep_is_not_a_tiers_figure(tmp_path):
    """results/goodput-load-*.json (`--concurrency 1,4,16,64`) has `loads`, not `arms`: the banner keeps
    reading the newest single-load result."""
    from kvtier.service.tier_report import newest_goodput

    single = {"arms": {"full": {}}, "settings": {"model_id": "m"}}
    (tmp_path / "goodput-cpu-2026-12-03.json").write_text(json.dumps(single))
    (tmp_path / "goodput-load-cpu-2026-12-03.json").write_text(json.dumps({"loads": {}, "settings": {"model_id": "m"}}))
    (tmp_path / "goodput-cpu-2026-12-01.json").write_text(json.dumps(single))
    assert newest_goodput("m", tmp_path)[0].name == "goodput-cpu-2026-12-03.json"
    # two workloads measured the same day: one of them by name, whatever order the directory lists them in
    same_day = [tmp_path / "goodput-long-mixed-cpu-2026-12-06.json", tmp_path / "goodput-long-local-cpu-2026-12-06.json"]
    for p in same_day:
        p.write_text(json.dumps(single))

    class Listed:   # a results folder that lists its files in a given order
        def __init__(self, order):
            self.order = order

        def glob(self, pattern):
            return [p for p in self.order if p.match(pattern)]

    for order in (same_day, same_day[::-1]):
        assert newest_goodput("m", Listed(order))[0].name == "goodput-long-mixed-cpu-2026-12-06.json"


def test_a_port_comparison_on_another_vllm_release_is_not_a_tiers_figure(tmp_path):
    """A goodput run on a vLLM release other than the one `make setup` installs (0.32 beside 0.31) is the
    port's comparison (docs/engine.md); the tier's figure stays the newest run on versions.DEFAULT."""
    from kvtier.engine.versions import DEFAULT, NEWEST
    from kvtier.service.tier_report import newest_goodput

    assert NEWEST != DEFAULT
    run = lambda vllm: {"arms": {"full": {}}, "settings": {"model_id": "m"}, "machine": {"vllm": vllm}}  # noqa: E731
    (tmp_path / "goodput-long-local-cpu-2026-12-06.json").write_text(json.dumps(run(DEFAULT)))
    (tmp_path / "goodput-long-local-vllm032-cpu-2026-12-07.json").write_text(json.dumps(run(NEWEST)))
    assert newest_goodput("m", tmp_path)[0].name == "goodput-long-local-cpu-2026-12-06.json"


def test_the_elastic_tier_and_auto_read_the_newest_load_sweep(tmp_path):
    """The banner's `across load` lines: per load, correct answers/s against the better of stock and the
    sweep's fixed-budget tiers, preemptions against stock's, accuracy at the lowest and highest load."""
    from kvtier.service.tier_report import sweep_lines

    cfg = load_config(DEMO_CONFIG)
    arm = lambda cps, pre, acc=1.0: {"correct_per_s": cps, "preemptions": pre,  # noqa: E731
                                     "accuracy": {"local": 1.0, "needle": acc}}
    loads = {str(c): {"arms": {"stock": arm(s, sp), "full": arm(9.0, sp), "k256": arm(k, 0, 0.3), "elastic": arm(e, 0, ea)},
                      "runs": [{}, {}, {}]}
             for c, s, sp, k, e, ea in ((1, 1.0, 0, 0.5, 0.9, 1.0), (64, 1.0, 40, 2.0, 2.2, 0.5))}
    (tmp_path / "goodput-load-cpu-2026-12-04.json").write_text(json.dumps(
        {"loads": loads, "settings": {"model_id": cfg.model_ids[0]}}))
    lines = sweep_lines(cfg, tmp_path)
    assert set(lines) == {"elastic"}       # fixed tiers and full attention have their single-load figures
    assert lines["elastic"] == ("loads 1/64: 0.90/1.10x the better of stock and k256 in correct answers/s, "
                                "preemptions 0/0 (stock 0/40); accuracy load 1: local 1.00, needle 1.00; load 64: "
                                "local 1.00, needle 0.50 [goodput-load-cpu-2026-12-04.json, median of 3 run(s)]")
    floor = next(t.floor for t in cfg.tiers if t.elastic)
    assert f"| `elastic` | elastic, floor K={floor} r=32 random | across load: loads 1/64" in markdown(cfg, tmp_path)
