"""``kernel="core"``: each GPU tier's core, the paper's kernel at teaching size, selected through the public API.

The cores are held to the cross-tier attention tests in ``test_tiers.py`` (the tiers ``numba-core`` and
``torch-core``); here, what selecting one means: its own runner runs, it folds no prior state and binds no
runs, and what it does not have (deterministic mode's chunk grid) is refused by name.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import bsrattn as ba
from test_tiers import CORE_TIERS, load_tier


@pytest.fixture(scope="module", params=CORE_TIERS)
def core(request):
    return load_tier(request.param)


def _problem():
    rng = np.random.default_rng(0)
    layout = ba.layouts.paged([1, 3], [[2, 0], [1]], kv_lens=[20, 9], page_size=16, num_pages=3)
    q = rng.standard_normal((4, 4, 16)).astype(np.float32)
    k, v = rng.standard_normal((2, 3, 16, 2, 16)).astype(np.float32)
    return layout, q, k, v


def test_the_core_runs_its_own_runner_and_agrees_with_the_shipped_kernel(core):
    layout, q, k, v = _problem()
    causal = ba.Variant(causal=True)
    attn = ba.BatchAttention(core.kind, kernel="core")
    attn.plan(layout, 4, 2, 16, variant=causal, num_ctas=3, fixed_split_size=8)
    module = importlib.import_module(f"{ba.backends.REGISTRY[core.kind]}.core")
    assert isinstance(attn._runners[0], module.Runner) and attn.work_plans[0].num_merges > 0
    args = [core.array(x, "float32") for x in (q, k, v)]
    planned = core.numpy(attn.run(*args))
    one_shot = core.numpy(ba.attention(*args, layout, variant=causal, backend=core.kind, kernel="core"))
    shipped = core.numpy(ba.attention(*args, layout, variant=causal, backend=core.kind))
    np.testing.assert_allclose(planned, shipped, atol=2e-5)
    np.testing.assert_allclose(one_shot, shipped, atol=2e-5)


def test_the_core_folds_no_prior_state_and_binds_no_runs(core):
    be = ba.get_backend(core.kind, "core")
    assert be.kernel == "core" and not be.folds_prior and not be.binds_runs
    assert repr(be) == f"Backend({core.kind!r}, 'core')"
    assert ba.get_backend(be) is be and ba.get_backend(be, "shipped").kernel == "shipped"


def test_the_core_refuses_deterministic_mode_by_name(core):
    layout, q, k, v = _problem()
    message = f"deterministic=True: the '{core.kind}' tier's core kernel has no chunk grid"
    with pytest.raises(ValueError, match=message):
        ba.attention(q, k, v, layout, backend=core.kind, kernel="core", deterministic=True)
    with pytest.raises(ValueError, match=message):
        ba.BatchAttention(core.kind, kernel="core").plan(layout, 4, 2, 16, deterministic=True)
