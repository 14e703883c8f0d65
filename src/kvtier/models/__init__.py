"""Model helpers: the deterministic tiny Qwen3 used by tests, demos and CPU benchmarks."""
