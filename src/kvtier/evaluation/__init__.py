"""Evaluation harness: accuracy under eviction with the paper's statistics, the probes, keep-log
statistics, and the transformers reference engine (see evaluation/README.md)."""
