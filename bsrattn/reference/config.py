"""Plan options: the scheduler's arguments for this tier, modelling the H200 the fast tiers run on."""

from __future__ import annotations

NUM_SMS = 132  # the H200 the reference models


def plan_options(spec) -> dict:
    """Scheduler options modelling a 132-SM GPU: one CTA per SM shared among the KV heads."""
    return dict(num_ctas=max(1, NUM_SMS // spec.num_kv_heads), tile_q=16, min_split_size=1, kv_align=1)
