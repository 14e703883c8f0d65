"""kvtier: serve long-reasoning LLMs and RL rollouts under a bounded KV cache.

The repository root is the `kvtier` package (see pyproject's package-dir mapping); each top-level
folder is one subpackage. Dependencies point one way: policies <- engine <- service, rollout, reference;
reference <- evaluation.
"""

__version__ = "0.1.0"
