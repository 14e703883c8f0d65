"""Task families that training (kvtier.models), evaluation and RL (kvtier.rollout) all draw from.

A leaf package (standard library only), so every layer can import it: `chains` holds the reasoner's task
families (two-term recurrences executed line by line; local chains and needles in the trace), chosen by
name: `chains`, the shipped reasoner's, and `chains-long` (2.5-4k-token traces, issue #36).
"""
