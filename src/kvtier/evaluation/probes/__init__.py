"""The planted-fact probe (paper §5.2, Appendix B) and the passcode probe (§5.3, Table 3).

Both run on the transformers reference engine: a short prefilled stub (chat template + think opener),
then a fully scripted body fed token by token through the **decode path** (so eviction treats it
exactly as generated reasoning and the model cannot restate anything): filler, the fact, filler, and a
terminal query whose value tokens are the measurement points. The query starts right after an
eviction round and fits inside the buffer, so the question itself is never evicted; ``distance`` is
the number of rounds in which the whole fact was a candidate before the query.

One job a module:

* `pinning`: `PinnedRandomPolicy` (the fact pinned in a condition's (layer, KV head) sites, evicted at
  first eligibility elsewhere, uniform draws for the rest), `verify_pins` (the audit check) and
  `parse_sites` (the `--conditions` syntax);
* `instances`: the scripted traces (`build_instances`, synthetic filler) and the score at the value tokens;
* `planted_fact`: `run_planted_fact` (retrieval, LP and the graded recall R of Eq. 4 with its bootstrap
  CI, per condition) and `format_planted`;
* `passcode`: `run_passcode` (Table 3: retrieval and mean log-probability per policy) and `format_passcode`.

The names below are imported from `kvtier.evaluation.probes` by the `kvtier eval probe-*` commands and
the tests.
"""

from kvtier.evaluation.probes.instances import ProbeInstance, build_instances, score_values, synthetic_filler
from kvtier.evaluation.probes.passcode import format_passcode, run_passcode
from kvtier.evaluation.probes.pinning import PinnedRandomPolicy, Site, parse_sites, verify_pins
from kvtier.evaluation.probes.planted_fact import format_planted, recall_ci, recall_R, run_planted_fact

__all__ = [
    "PinnedRandomPolicy", "ProbeInstance", "Site", "build_instances", "format_passcode", "format_planted",
    "parse_sites", "recall_R", "recall_ci", "run_passcode", "run_planted_fact", "score_values",
    "synthetic_filler", "verify_pins",
]
