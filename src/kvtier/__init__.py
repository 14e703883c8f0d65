"""kvtier: serve long-reasoning LLMs and RL rollouts under a bounded KV cache.

The package is src/kvtier/ in the repository (src layout, see pyproject.toml); each folder is one
subpackage. Dependencies point one way: policies <- engine <- service, rollout, reference;
reference <- evaluation.
"""

__version__ = "0.1.0"
