"""`kvtier eval attention-profile`: where each attention head of a model looks, on gold traces.

Teacher-forced under full attention (the model's forward over bos + prompt + the gold trace, attention
weights from kvtier.deathtime's explicit path), per (layer, query head), averaged over every trace query:

* ``share_older_than_r``: attention mass on keys more than r positions back (what eviction can take away;
  the r newest are the never-evicted buffer);
* ``effective_keys``: exp(entropy) of the query's attention (1: one key; large: a diffuse background);
* ``prompt_share``: mass on the prompt (what Random Attention always keeps).

A model that solves the chain task needs only the prompt and the previous line (10 tokens, inside r = 32),
so mass older than r is what its accuracy under eviction depends on (issue #23's finding on the shipped
reasoner: 12 of 16 heads put > 70% there).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def attention_profile(model_dir: str, problems: int = 16, buffer: int = 32, kinds: tuple = ("local",)) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvtier.deathtime import ATTN_NAME, register
    from kvtier.models.reasoner_data import encode_problem
    from kvtier.tasks import chains

    register()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=ATTN_NAME).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = model.config
    L, Hq = cfg.num_hidden_layers, cfg.num_attention_heads
    sums = {k: torch.zeros(L, Hq, dtype=torch.float64) for k in ("older", "effective", "prompt")}
    count = 0
    for kind in kinds:
        for p in chains.eval_problems(problems, kind):
            prompt, trace = encode_problem(tok, p)
            ids = prompt + trace[:-1]                                                        # no eos query
            n, P = len(ids), len(prompt)
            att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions   # L x [1, Hq, n, n]
            w = torch.stack([a[0] for a in att]).double()[:, :, P:]                         # trace queries
            q = torch.arange(P, n).view(-1, 1)
            k = torch.arange(n).view(1, -1)
            sums["older"] += (w * (k < q - buffer + 1)).sum(-1).sum(-1)
            sums["prompt"] += w[..., :P].sum(-1).sum(-1)
            ent = -(w * w.clamp(min=1e-30).log()).sum(-1)
            sums["effective"] += ent.exp().sum(-1)
            count += n - P
    mean = {k: (v / count) for k, v in sums.items()}
    heads = [{"layer": l, "head": h, "kv_head": h // (Hq // cfg.num_key_value_heads),
              "share_older_than_r": round(float(mean["older"][l, h]), 4),
              "effective_keys": round(float(mean["effective"][l, h]), 1),
              "prompt_share": round(float(mean["prompt"][l, h]), 4)} for l in range(L) for h in range(Hq)]
    return {"model": str(model_dir), "buffer": buffer, "problems": problems, "kinds": list(kinds),
            "heads": heads, "heads_over_70pct_older": sum(h["share_older_than_r"] > 0.7 for h in heads),
            "mean_share_older_than_r": round(float(mean["older"].mean()), 4),
            "mean_effective_keys": round(float(mean["effective"].mean()), 1)}
