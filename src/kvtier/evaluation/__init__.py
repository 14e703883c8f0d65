"""Evaluation harness: accuracy under eviction with the paper's statistics, the probes and keep-log
statistics, on the vLLM engine or the transformers reference engine (kvtier.reference; see
evaluation/README.md)."""
