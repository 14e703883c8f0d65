"""Task families that training (kvtier.models), evaluation and RL (kvtier.rollout) all draw from.

A leaf package (standard library only), so every layer can import it: `chains` is the shipped reasoner's
family (two-term recurrences executed line by line; local chains and needles in the trace).
"""
