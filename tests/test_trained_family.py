"""The commands that grade a reasoner's task default to the task family the model was trained on (its
TRAINING.json's `family`): a long model is graded on its long traces without a --family, and the service's
example request is one of its problems with its family's token budget."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from kvtier.models.reasoner import REASONER_DIR, REASONER_EVICT_DIR, REASONER_LONG_DIR, trained_family


def _long_copy(tmp_path, name="long"):
    """The shipped reasoner's files with a TRAINING.json saying it was trained on chains-long."""
    d = tmp_path / name
    shutil.copytree(REASONER_DIR, d)
    (d / "TRAINING.json").write_text(json.dumps({"family": "chains-long", "steps": 1}))
    return d


def _flat(output: str) -> str:
    """A CLI error's text without the rich box's borders and line breaks."""
    return " ".join(output.replace("│", " ").split())


def test_the_family_comes_from_the_training_record(tmp_path):
    assert trained_family(REASONER_DIR) == "chains" and trained_family(REASONER_EVICT_DIR) == "chains"  # predate the field
    assert trained_family(REASONER_LONG_DIR) == "chains-long"
    assert trained_family(_long_copy(tmp_path)) == "chains-long"
    assert trained_family(tmp_path / "no-such-model") == "chains"
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "TRAINING.json").write_text("[1, 2]")
    assert trained_family(tmp_path / "odd") == "chains"
    (tmp_path / "odd" / "TRAINING.json").write_text('{"family": ["chains-long"]}')
    assert trained_family(tmp_path / "odd") == "chains"
    # an exported checkpoint (`kvtier model export-checkpoint`) records its training config in EXPORT.json
    (tmp_path / "exported").mkdir()
    (tmp_path / "exported" / "EXPORT.json").write_text(json.dumps({"step": 500, "config": {"family": "chains-long"}}))
    assert trained_family(tmp_path / "exported") == "chains-long"


def test_models_family_is_the_models_or_the_given_one(tmp_path):
    from kvtier.models.reasoner import models_family

    long = str(_long_copy(tmp_path))
    assert models_family(None, [long]) == "chains-long"
    assert models_family("chains", [long]) == "chains"                 # --family wins
    with pytest.raises(ValueError, match="unknown task family"):
        models_family("nope", [long])
    with pytest.raises(ValueError, match="different task families.*--family"):
        models_family(None, [long, str(REASONER_DIR)])
    (tmp_path / "future").mkdir()
    (tmp_path / "future" / "TRAINING.json").write_text('{"family": "chains-huge"}')
    with pytest.raises(ValueError, match="records training on 'chains-huge'.*pass --family"):
        models_family(None, [str(tmp_path / "future")])


def test_eval_reasoner_grades_a_long_model_on_long_traces_without_family(tmp_path):
    """The long copy has the shipped model's 2,048 positions: graded on its recorded chains-long, the
    command refuses before any engine because the family's traces do not fit (graded on chains it would run)."""
    from typer.testing import CliRunner

    from kvtier.cli import app

    res = CliRunner().invoke(app, ["eval", "reasoner", "--model", str(_long_copy(tmp_path)), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "task family chains-long needs max_model_len" in _flat(res.output), res.output


def test_probe_heads_refuses_models_of_different_families_without_family(tmp_path):
    from typer.testing import CliRunner

    from kvtier.cli import app

    res = CliRunner().invoke(app, ["eval", "probe-heads", "--model", str(_long_copy(tmp_path)),
                                   "--model", str(REASONER_DIR), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "different task families" in _flat(res.output), res.output
    assert "pass --family" in _flat(res.output)


def test_goodput_grades_the_configs_model_on_its_own_family(tmp_path):
    """A config serving a chains-long model at the earlier demo's max_model_len (1,536): with no --family the
    benchmark takes chains-long from the model, and refuses before any server because its traces do not fit."""
    from typer.testing import CliRunner

    from kvtier.cli import app
    from kvtier.service.config import DEFAULT_CONFIG

    cfg = yaml.safe_load(DEFAULT_CONFIG.with_name("reasoner.yaml").read_text())
    (eng,) = cfg["engines"].values()
    eng["model"], eng["max_model_len"] = str(_long_copy(tmp_path)), 1536
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = CliRunner().invoke(app, ["bench", "goodput", "--config", str(path), "--workdir", str(tmp_path / "w")])
    assert res.exit_code == 2 and "chains-long needs max_model_len >= 4064" in _flat(res.output), res.output
    # a family this version does not know: named with where it came from, the same words as `kvtier eval`'s
    (tmp_path / "long" / "TRAINING.json").write_text('{"family": "chains-huge"}')
    res = CliRunner().invoke(app, ["bench", "goodput", "--config", str(path), "--workdir", str(tmp_path / "w")])
    assert res.exit_code == 2 and "records training on 'chains-huge'" in _flat(res.output), res.output
    assert "pass --family" in _flat(res.output)


@pytest.mark.parametrize("model, max_model_len, fam, max_tokens", [
    ("reasoner-long", None, "chains-long", 4000),   # the demo config's model (records its family)
    ("reasoner-evict", 1536, "chains", 1200),       # the earlier demo model (predates the field)
])
def test_goodput_grades_a_shipped_model_on_its_family(tmp_path, monkeypatch, model, max_model_len, fam, max_tokens):
    """No --family: the problems and max_tokens are the config's model's family's (the run is a stand-in)."""
    from typer.testing import CliRunner

    from kvtier.benchmarks import goodput
    from kvtier.cli import app
    from kvtier.service.config import DEFAULT_CONFIG
    from kvtier.tasks.chains import family

    cfg = yaml.safe_load(DEFAULT_CONFIG.with_name("reasoner.yaml").read_text())
    (eng,) = cfg["engines"].values()
    eng["model"] = model
    eng["max_model_len"] = max_model_len or eng["max_model_len"]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    seen = {}

    def fake(settings, config, tasks, arms, runs, workdir, concurrency, max_tokens, seed, log, family, **_):
        seen.update(family=family, max_tokens=max_tokens, prompts={t.prompt for t in tasks})
        return {"arms": {}}

    monkeypatch.setattr(goodput, "run_goodput", fake)
    res = CliRunner().invoke(app, ["bench", "goodput", "--config", str(tmp_path / "c.yaml"), "--problems", "2",
                                   "--arms", "stock", "--workdir", str(tmp_path / "w")])
    assert res.exit_code == 0, res.output
    assert seen["family"] == fam and seen["max_tokens"] == max_tokens
    assert seen["prompts"] == {p.prompt for k in ("local", "needle") for p in family(fam).eval_problems(2, k)}


def test_the_service_example_is_a_problem_of_the_models_family(tmp_path, monkeypatch):
    from kvtier.models import reasoner
    from kvtier.service.config import DEFAULT_CONFIG, load_config
    from kvtier.service.serve_cli import task_example
    from kvtier.tasks.chains import CHAINS, CHAINS_LONG

    cfg = load_config(DEFAULT_CONFIG.with_name("reasoner.yaml"))
    model_id = cfg.model_ids[0]
    assert task_example(cfg, model_id) == (CHAINS_LONG.eval_problems(1, "local")[0].prompt, 4000)   # the demo's
    raw = yaml.safe_load(DEFAULT_CONFIG.with_name("reasoner.yaml").read_text())
    (eng,) = raw["engines"].values()
    eng["model"], eng["max_model_len"] = "reasoner-evict", 1536      # the earlier demo model: chains
    (tmp_path / "evict.yaml").write_text(yaml.safe_dump(raw))
    evict = load_config(tmp_path / "evict.yaml")
    assert task_example(evict, model_id) == (CHAINS.eval_problems(1, "local")[0].prompt, 1200)
    monkeypatch.setitem(reasoner.SHIPPED, "reasoner-evict", _long_copy(tmp_path, "shipped-long"))
    assert task_example(evict, model_id) == (CHAINS_LONG.eval_problems(1, "local")[0].prompt, 4000)
    # a reasoner served from its training directory: the family it records
    eng["model"] = str(_long_copy(tmp_path))
    (tmp_path / "long.yaml").write_text(yaml.safe_dump(raw))
    assert task_example(load_config(tmp_path / "long.yaml"), model_id)[1] == 4000
    eng["model"] = str(tmp_path / "hf-model")                          # no record: not a reasoner of ours
    (tmp_path / "hf-model").mkdir()
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(raw))
    assert task_example(load_config(tmp_path / "other.yaml"), model_id) is None
    assert task_example(load_config(DEFAULT_CONFIG), load_config(DEFAULT_CONFIG).model_ids[0]) is None  # not a reasoner
