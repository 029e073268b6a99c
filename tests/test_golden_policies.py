"""The behaviour lock (experiments/golden_policies.py) ignores wall times at every level."""
from experiments.golden_policies import _without_timings


def test_wall_times_are_dropped_nested_ones_too():
    stats = {"wall_s": 1.5, "timings": {"total_s": 2.0}, "nfe": [3],
             "draft": {"wall_s": 0.7, "nfe": [2], "tokens": [[5, 6]]}}
    assert _without_timings(stats) == {"nfe": [3], "draft": {"nfe": [2], "tokens": [[5, 6]]}}
