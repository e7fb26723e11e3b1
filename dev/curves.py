"""What the dev/ sweeps read off a run's val curve, shared by dev/muon_vs_adamw.py and dev/arch_compare.py."""


def steps_to_reach(val: dict[int, float], target: float) -> float | None:
    """The first step at which the val curve (linearly interpolated between evaluations) is at or below target."""
    points = sorted(val.items())
    for (s0, v0), (s1, v1) in zip(points, points[1:]):
        if v1 <= target:
            return s0 + (v0 - target) / (v0 - v1) * (s1 - s0) if v0 > target else s0
    return None
