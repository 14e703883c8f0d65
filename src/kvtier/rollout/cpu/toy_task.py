"""The toy task of `kvtier rl smoke --task toy`: prompts any model can answer and a dense reward (verl loads
this file by path: `reward.custom_reward_function.path`, `name=compute_score`)."""

from __future__ import annotations

from pathlib import Path

PROMPTS = [
    "Let x = 42. What is x times seven? Think step by step before answering.",
    "A train leaves at noon at sixty miles per hour; another leaves an hour later at eighty. When does the "
    "second catch up?",
    "Prove that the sum of two even numbers is even.",
    "Count from one to ten and explain each step.",
    "What is the capital of France? Explain how you know.",
    "Write a short story about a robot that learns to paint.",
    "List three prime numbers greater than twenty and justify each.",
    "Explain why the sky is blue in simple words.",
]


def compute_score(data_source=None, solution_str: str = "", ground_truth=None, extra_info=None, **kwargs) -> float:
    """A dense toy reward for a random model: the share of the letter 'e' in the response (GRPO needs
    different rewards within a group; the tiny model's text is gibberish)."""
    text = solution_str or ""
    return 10.0 * text.count("e") / max(1, len(text))


def write_dataset(directory: Path, n: int) -> tuple[Path, Path]:
    import pandas as pd

    rows = []
    for i in range(n):
        prompt = PROMPTS[i % len(PROMPTS)] + (f" (variant {i // len(PROMPTS)})" if i >= len(PROMPTS) else "")
        rows.append({"data_source": "kvtier_smoke", "prompt": [{"role": "user", "content": prompt}],
                     "ability": "toy", "reward_model": {"style": "rule", "ground_truth": "e"},
                     "extra_info": {"index": i}})
    directory.mkdir(parents=True, exist_ok=True)
    train, val = directory / "train.parquet", directory / "val.parquet"
    pd.DataFrame(rows).to_parquet(train)
    pd.DataFrame(rows[:2]).to_parquet(val)
    return train, val
