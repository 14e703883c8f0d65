"""`kvtier eval trace-errors` (src/kvtier/evaluation/trace_errors.py): teacher-forced mistakes by field."""

from __future__ import annotations

import pytest
import torch

from kvtier.evaluation.trace_errors import FIELDS, field_of, trace_errors
from kvtier.models.reasoner import REASONER_DIR


def test_each_line_is_named_by_its_field():
    assert [field_of(line, i) for line, i in (("100 73 50", 0), ("099 50 24", 1), ("k=12", 34), ("?k", 300),
                                               ("\\boxed{12}", 301))] == \
        ["start", "line", "key_line", "question", "answer"]


def test_an_untrained_model_errs_everywhere_and_every_error_is_counted_once(tmp_path):
    from transformers import Qwen3ForCausalLM

    from kvtier.models.reasoner import build_reasoner_tokenizer, reasoner_config
    from kvtier.models.reasoner_save import save_model

    torch.manual_seed(0)
    save_model(Qwen3ForCausalLM(reasoner_config("base")), build_reasoner_tokenizer(), tmp_path / "m")
    res = trace_errors(str(tmp_path / "m"), problems=1)
    assert res["per_kind"]["local"]["traces_wrong"] == res["per_kind"]["needle"]["traces_wrong"] == 1
    assert sum(sum(k["by_field"].values()) for k in res["per_kind"].values()) == len(res["errors"]) > 100
    assert {e["field"] for e in res["errors"]} <= set(FIELDS) and {"question", "answer", "line"} <= {e["field"] for e in res["errors"]}
    assert all(e["p_gold"] <= e["p_predicted"] and e["gold"] != e["predicted"] for e in res["errors"])


@pytest.mark.skipif(not (REASONER_DIR / "model.safetensors").exists(), reason="shipped reasoner not present")
def test_the_shipped_reasoner_makes_no_mistake_on_held_out_traces():
    res = trace_errors(str(REASONER_DIR), problems=2)
    assert res["errors"] == [] and all(k["traces_wrong"] == 0 for k in res["per_kind"].values())
