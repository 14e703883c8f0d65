"""kvtier.evaluation.stats: the power of a paired read (issue #59)."""

import pytest


def test_detectable_change_shrinks_with_problems_and_seeds_and_is_bounded():
    """#59's power: the smallest change a paired read detects (80% power, two-sided 5%)."""
    from kvtier.evaluation.stats import detectable_change

    d32, d96 = detectable_change(0.27, 32), detectable_change(0.27, 96)
    assert 0 < d96 < d32 < 0.73
    assert detectable_change(0.27, 96, seeds=3) < d96
    # at the ceiling a fall needs no variance at the start: 96 problems see a drop of ~0.06, not of 0.01
    assert 0.03 < detectable_change(1.0, 96, direction=-1) < 0.1
    # one problem cannot show anything: the whole room
    assert detectable_change(0.5, 1) == 0.5
    with pytest.raises(ValueError):
        detectable_change(1.5, 10)
