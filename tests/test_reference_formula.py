"""The reference microkernel's two paths agree: the formula (``attend``) and the fast path the tier runs
(``attend_tiles``, which tiles the queries, reads each tile's span of visible keys only and runs the softmax in
place).

On random tiles (every variant, custom masks, NaN and infinities at random places of q, k and v) and on the
named corners of the rules for numbers that are not numbers, the two agree to rounding, NaN and ±inf exactly
(``bsrattn.testing``'s tolerances), whether the fast path takes all the queries in one tile or one at a time.
The corners also check the rule itself on the formula.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import bsrattn as ba
from bsrattn.reference import microkernel
from bsrattn.reference.microkernel import attend, attend_tiles
from bsrattn.testing import assert_close
from strategies import variants

# The tiles hold NaN and infinities on purpose; NumPy warns where they meet.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

SPECIALS = (np.nan, np.inf, -np.inf)


@st.composite
def tiles(draw):
    """``(args, kwargs)`` of :func:`attend`: ``n`` queries (consecutive positions, some of which may see no key)
    over ``m`` keys, a variant, a custom mask or none, and a few NaN or infinities in q, k and v."""
    n, m = draw(st.integers(1, 6)), draw(st.integers(0, 24))
    hkv = draw(st.integers(1, 2))
    hq, d = hkv * draw(st.integers(1, 3)), draw(st.sampled_from([4, 8]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    q = rng.standard_normal((n, hq, d)) * draw(st.sampled_from([1.0, 30.0]))
    k, v = rng.standard_normal((m, hkv, d)), rng.standard_normal((m, hkv, d))
    for x in (q, k, v):
        for _ in range(draw(st.integers(0, 2)) if x.size else 0):
            x.reshape(-1)[draw(st.integers(0, x.size - 1))] = draw(st.sampled_from(SPECIALS))
    start = draw(st.integers(0, 8))
    k_pos = np.arange(start, start + m)
    q_pos = np.arange(n) + draw(st.integers(start - n, start + m))
    variant = draw(variants(hq))
    kwargs = dict(mask=rng.random((n, m)) < 0.7 if draw(st.booleans()) else None,
                  dtype=draw(st.sampled_from([np.float64, np.float32])), k_rope_offset=draw(st.integers(0, 5)),
                  q_rope_pos=q_pos + draw(st.integers(0, 5)) if draw(st.booleans()) else None)
    return (q, k, v, q_pos, k_pos, variant, variant.scale(d)), kwargs


def assert_paths_agree(args, kwargs):
    """``attend_tiles`` equals ``attend`` to rounding, in one tile and in tiles of one query; returns attend's."""
    want_o, want_lse = attend(*args, **kwargs)
    dtype = np.dtype(kwargs.get("dtype", np.float64)).name
    sigmoid = args[5].use_sigmoid
    for tile_scores in (microkernel.TILE_SCORES, 1):
        with mock.patch.object(microkernel, "TILE_SCORES", tile_scores):
            o, lse = attend_tiles(*args, **kwargs)
        assert o.dtype == want_o.dtype and lse.dtype == want_lse.dtype
        assert_close(o, want_o, "attention", dtype, name=f"o, tiles of {tile_scores} scores")
        if sigmoid:
            assert np.isnan(lse).all() and np.isnan(want_lse).all()
        else:
            assert_close(lse, want_lse, "lse", dtype, name=f"lse, tiles of {tile_scores} scores")
    return want_o, want_lse


@given(tiles())
def test_the_fast_path_matches_the_formula(tile):
    assert_paths_agree(*tile)


def _corner(v_at=None, k_at=None, q=None, causal=True, variant=None, q_pos=(5, 6)):
    """Two queries at ``q_pos`` over four keys at positions 3..6, one head, head_dim 2; ``k_at``/``v_at`` set one
    entry (``(key, dim, value)``) of ``k``/``v``."""
    q = np.ones((2, 1, 2)) if q is None else np.asarray(q, float).reshape(2, 1, 2)
    k = np.arange(8.0).reshape(4, 1, 2) / 8
    v = np.arange(8.0).reshape(4, 1, 2) + 1
    for x, at in ((k, k_at), (v, v_at)):
        if at is not None:
            x[at[0], 0, at[1]] = at[2]
    variant = ba.Variant(causal=causal) if variant is None else variant
    return (q, k, v, np.array(q_pos), np.arange(3, 7), variant, 1.0), {}


# What the formula must give at each corner, per query row: "empty" (o 0, lse -inf), "o nan" (lse finite), "nan"
# (o and lse NaN) or "finite".
CORNERS = {
    "every key hidden (queries before the keys)": (_corner(q_pos=(1, 2)), ("empty", "empty")),
    "no keys at all": (((np.ones((2, 1, 2)), np.zeros((0, 1, 2)), np.zeros((0, 1, 2)), np.array([5, 6]),
                         np.arange(0), ba.Variant(), 1.0), {}), ("empty", "empty")),
    "NaN v of a causally hidden key": (_corner(v_at=(3, 0, np.nan)), ("finite", "o nan")),
    "inf v of a visible key": (_corner(v_at=(1, 1, np.inf)), ("o nan", "o nan")),
    "+inf score": (_corner(k_at=(0, 0, np.inf)), ("nan", "nan")),
    "-inf score weighs 0": (_corner(k_at=(0, 0, -np.inf)), ("finite", "finite")),
    "NaN q of one query": (_corner(q=[np.nan, 1, 1, 1]), ("nan", "finite")),
    "every visible score -inf: empty whatever v holds": (
        _corner(q=[1, 1, 1, 1], q_pos=(3, 3), k_at=(0, 0, -np.inf), v_at=(0, 1, np.nan)), ("empty", "empty")),
    "FlashSigmoid, NaN v of a visible key": (
        _corner(v_at=(2, 0, np.nan), variant=ba.Variant(causal=True, sigmoid_bias=-1.0)), ("o nan", "o nan")),
}


@pytest.mark.parametrize("corner", sorted(CORNERS))
def test_the_corners_of_the_rules(corner):
    (args, kwargs), want = CORNERS[corner]
    o, lse = assert_paths_agree(args, kwargs)
    sigmoid = args[5].use_sigmoid
    for row, rule in enumerate(want):
        o_row, lse_row = o[row], lse[row]
        if rule == "empty":
            assert (o_row == 0).all() and (lse_row == -np.inf).all(), (row, o_row, lse_row)
        elif rule == "nan":
            assert np.isnan(o_row).all() and np.isnan(lse_row).all(), (row, o_row, lse_row)
        else:
            assert np.isnan(o_row).all() == (rule == "o nan") and np.isfinite(o_row).all() == (rule == "finite")
            assert np.isnan(lse_row).all() if sigmoid else np.isfinite(lse_row).all(), (row, lse_row)
