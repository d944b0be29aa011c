"""Cross-tier tests: every tier, through the public API and the backend flag, against the float64 reference.

One fixture, ``backend``, runs each test on ``"reference"``, ``"numba"`` and ``"torch"``; a tier whose
package is missing or not built here is skipped with the reason. Inputs are drawn in float64, rounded
through the dtype under test, handed to the tier in its own array kind (torch tensors on CUDA when there is
a GPU, else on the CPU for the Triton interpreter; NumPy for numba, which runs under the CUDA simulator
without a GPU), and compared with the reference tier on the same rounded values in float64, at the
tolerance of the dtype (``bsrattn.testing``).

The simulator runs each CUDA thread as a Python thread and the interpreter is slow too, so the non-reference
tiers draw few, tiny examples (``TIER_EXAMPLES``). Real sizes run in ``test_tiers_gpu.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bsrattn as ba
from bsrattn.testing import assert_close
from helpers import call_inputs, raw_tensors
from strategies import EDGE_CASES, LAYOUT_STRATEGIES, partial_states, problems

TIERS = ("reference", "numba", "torch")
# dtypes each tier is checked in here (no GPU needed); bf16 and fp8 on the GPU tiers run in test_tiers_gpu.py.
TIER_DTYPES = {
    "reference": ("float64", "float32", "float16", "bfloat16"),
    "numba": ("float32", "float16"),
    "torch": ("float32", "float16"),
}
# Hypothesis examples per property on the slow tiers (None: the profile's default).
TIER_EXAMPLES = {"reference": None, "numba": 6, "torch": 6}
# Per layout kind (8 kinds), the slow tiers draw fewer still.
TIER_EXAMPLES_PER_KIND = {"reference": None, "numba": 2, "torch": 2}

NUMPY_DTYPES = {
    "float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2,
}
_TIER_DEPENDENCIES = {"numba": ("numba",), "torch": ("torch", "triton")}


@dataclass
class Tier:
    """A loaded tier and how to move arrays to and from the kind it runs on."""

    name: str
    backend: ba.Backend

    @property
    def dtypes(self) -> tuple:
        return TIER_DTYPES[self.name]

    def examples(self, per_kind=False):
        """A Hypothesis settings decorator with this tier's example budget."""
        n = (TIER_EXAMPLES_PER_KIND if per_kind else TIER_EXAMPLES)[self.name]
        return settings(max_examples=n) if n else settings()

    def array(self, x, dtype: str):
        """NumPy values -> this tier's array kind in ``dtype`` (torch: a tensor on CUDA if present, else CPU)."""
        x = np.ascontiguousarray(np.asarray(x).astype(NUMPY_DTYPES[dtype]))
        if self.name != "torch":
            return x
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        wide = np.float64 if dtype == "float64" else np.float32
        return torch.from_numpy(x.astype(wide)).to(device=device, dtype=getattr(torch, dtype))

    def native(self, x, dtype: str):
        """Like :meth:`array`, but in the kind the tier runs on: a Numba device array for numba."""
        if self.name != "numba":
            return self.array(x, dtype)
        from numba import cuda

        return cuda.to_device(self.array(x, dtype))

    @staticmethod
    def numpy(x) -> np.ndarray:
        """Any tier's output as float64 NumPy."""
        if hasattr(x, "detach"):
            return x.detach().double().cpu().numpy()
        if hasattr(x, "copy_to_host"):
            x = x.copy_to_host()
        return np.asarray(x).astype(np.float64)


def load_tier(name: str) -> Tier:
    """The tier ``name``, or a pytest skip saying why it cannot load here."""
    try:
        return Tier(name, ba.get_backend(name))
    except ba.BackendError as err:
        pytest.skip(f"{name} tier unavailable: {err}")
    except ModuleNotFoundError as err:
        ours = err.name == ba.backends.REGISTRY[name] or (err.name or "").split(".")[0] in _TIER_DEPENDENCIES[name]
        if not ours:
            raise
        pytest.skip(f"{name} tier not built here: {err}")


@pytest.fixture(scope="module", params=TIERS)
def backend(request) -> Tier:
    return load_tier(request.param)


def _rounded(dtype, *arrays):
    return tuple(np.asarray(a).astype(NUMPY_DTYPES[dtype]).astype(np.float64) for a in arrays)


def plan_heads(problem):
    """Head counts as the call sees them (Quest's per-head views: G query heads over one KV head)."""
    if problem.case.kind == "quest":
        return problem.num_qo_heads // problem.num_kv_heads, 1
    return problem.num_qo_heads, problem.num_kv_heads


def check_against_reference(tier, problem, dtype, run):
    """Run ``run(q, k, v, kv_layout) -> out or (out, lse)`` on the tier and compare with the reference."""
    case, variant = problem.case, problem.variant
    q, k, v = raw_tensors(problem, dtype)
    q, k, v, kv_layout = call_inputs(case, q, k, v)
    want = ba.attention(q, k, v, case.layout, variant=variant, kv_layout=kv_layout, backend="reference",
                        return_lse=not variant.use_sigmoid)
    want_o, want_lse = want if not variant.use_sigmoid else (want, None)
    got = run(tier.array(q, dtype), tier.array(k, dtype), tier.array(v, dtype), kv_layout)
    got_o, got_lse = got if not variant.use_sigmoid else (got, None)
    name = f"{tier.name} {case.kind} {dtype}"
    assert_close(tier.numpy(got_o), want_o, "attention", dtype, name=f"{name} out")
    if got_lse is not None:
        assert_close(tier.numpy(got_lse), want_lse, "lse", dtype, name=f"{name} lse")
    return got_o, got_lse


def attention_call(tier, problem):
    def run(q, k, v, kv_layout):
        return ba.attention(q, k, v, problem.case.layout, variant=problem.variant, kv_layout=kv_layout,
                            backend=tier.name, return_lse=not problem.variant.use_sigmoid)
    return run


# ---- one-shot attention -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(LAYOUT_STRATEGIES))
def test_attention_every_layout(backend, kind):
    @backend.examples(per_kind=True)
    @given(problems([kind]), st.sampled_from(backend.dtypes))
    def check(problem, dtype):
        check_against_reference(backend, problem, dtype, attention_call(backend, problem))

    check()


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_attention_edge_cases(backend, name):
    problem = EDGE_CASES[name]
    check_against_reference(backend, problem, "float32", attention_call(backend, problem))


def test_attention_any_layout_any_dtype(backend):
    @backend.examples()
    @given(problems(), st.sampled_from(backend.dtypes))
    def check(problem, dtype):
        check_against_reference(backend, problem, dtype, attention_call(backend, problem))

    check()


def test_masked_rows_are_zero_with_minus_inf_lse(backend):
    problem = EDGE_CASES["every key masked (causal, qo_len > kv_len)"]
    out, lse = check_against_reference(backend, problem, "float32", attention_call(backend, problem))
    out, lse = backend.numpy(out), backend.numpy(lse)
    # Queries 0 and 1 sit at positions -2 and -1: they see no key.
    assert (out[:2] == 0).all() and (lse[:2] == -np.inf).all()
    assert np.isfinite(lse[2:]).all()


# ---- plan / run ---------------------------------------------------------------------------------------

@st.composite
def plan_options(draw):
    choice = draw(st.sampled_from(["balanced", "fixed", "disabled"]))
    return dict(num_ctas=draw(st.integers(1, 4)),
                fixed_split_size=draw(st.integers(1, 8)) if choice == "fixed" else None,
                disable_split_kv=choice == "disabled")


def batch_call(tier, problem, dtype, options, runs=2):
    """``BatchAttention`` planned once and run ``runs`` times; the runs must agree bit for bit."""
    hq, hkv = plan_heads(problem)
    attn = ba.BatchAttention(backend=tier.name)

    def run(q, k, v, kv_layout):
        attn.plan(problem.case.layout, hq, hkv, problem.head_dim, variant=problem.variant, q_dtype=dtype,
                  kv_dtype=dtype, kv_layout=kv_layout, **options)
        results = [attn.run(q, k, v, return_lse=not problem.variant.use_sigmoid) for _ in range(runs)]
        first = results[0] if not problem.variant.use_sigmoid else (results[0],)
        for other in results[1:]:
            other = other if not problem.variant.use_sigmoid else (other,)
            for a, b in zip(first, other):
                np.testing.assert_array_equal(tier.numpy(a), tier.numpy(b), err_msg="same plan, different bits")
        return results[0]
    return run, attn


def test_batch_attention_any_layout(backend):
    @backend.examples()
    @given(problems(), st.sampled_from(backend.dtypes), plan_options())
    def check(problem, dtype, options):
        run, _ = batch_call(backend, problem, dtype, options)
        check_against_reference(backend, problem, dtype, run)

    check()


def _paged_problem(variant=ba.Variant(causal=True), hq=4, hkv=2):
    from strategies import LayoutCase, Problem

    raw = dict(qo_lens=[3, 1, 2], page_tables=[[5, 1, 7, 2], [0, 3], [6, 4]], kv_lens=[29, 12, 11], page_size=8,
               num_pages=8)
    return Problem(LayoutCase("paged", raw, ba.layouts.paged(**raw), "NHD"), hq, hkv, 8, variant, seed=3)


@pytest.mark.parametrize("options", [dict(num_ctas=4), dict(num_ctas=3, fixed_split_size=5),
                                     dict(num_ctas=2, disable_split_kv=True)],
                         ids=["balanced-splits", "fixed_split_size", "disable_split_kv"])
def test_batch_attention_split_modes(backend, options):
    problem = _paged_problem()
    run, attn = batch_call(backend, problem, "float32", options)
    check_against_reference(backend, problem, "float32", run)
    (work_plan,) = attn.work_plans
    assert (work_plan.num_merges > 0) == (not options.get("disable_split_kv", False))


def test_batch_attention_cascade(backend):
    problem = EDGE_CASES["shared prefix, empty suffix"]
    for options in (dict(num_ctas=4), dict(num_ctas=2, fixed_split_size=3)):
        run, attn = batch_call(backend, problem, "float32", options)
        check_against_reference(backend, problem, "float32", run)
        assert len(attn.work_plans) == 2 and attn.work_plans[0].num_merges > 0


def test_run_writes_out_and_lse_buffers(backend):
    problem = _paged_problem()
    q, k, v = raw_tensors(problem, "float32")
    attn = ba.BatchAttention(backend=backend.name)
    attn.plan(problem.case.layout, 4, 2, 8, variant=problem.variant, q_dtype="float32", kv_dtype="float32")
    out = backend.array(np.zeros(q.shape), "float32")
    lse = backend.array(np.zeros(q.shape[:2]), "float32")
    got_o, got_lse = attn.run(backend.array(q, "float32"), backend.array(k, "float32"), backend.array(v, "float32"),
                              out=out, lse=lse, return_lse=True)
    want_o, want_lse = ba.attention(q, k, v, problem.case.layout, variant=problem.variant, return_lse=True,
                                    backend="reference")
    assert_close(backend.numpy(out), want_o, "attention", "float32", name="out buffer")
    assert_close(backend.numpy(lse), want_lse, "lse", "float32", name="lse buffer")
    np.testing.assert_array_equal(backend.numpy(got_o), backend.numpy(out))
    np.testing.assert_array_equal(backend.numpy(got_lse), backend.numpy(lse))


def test_returns_the_array_kind_it_was_given(backend):
    problem = _paged_problem()
    q, k, v = raw_tensors(problem, "float32")
    layout = problem.case.layout
    native_q = backend.native(q, "float32")
    native = ba.attention(native_q, *(backend.native(x, "float32") for x in (k, v)), layout, backend=backend.name)
    from_numpy = ba.attention(*(x.astype(np.float32) for x in (q, k, v)), layout, backend=backend.name)
    assert isinstance(from_numpy, np.ndarray) and from_numpy.dtype == np.float32
    assert type(native) is type(native_q)
    np.testing.assert_array_equal(backend.numpy(native), backend.numpy(from_numpy))


# ---- merge through the flag ---------------------------------------------------------------------------

def test_merge_state(backend):
    from bsrattn.reference import merge_state as ref_merge_state

    @backend.examples()
    @given(partial_states(min_states=2, max_states=2), st.sampled_from([d for d in backend.dtypes if d != "float64"]))
    def check(states, dtype):
        o, lse = states
        (o,) = _rounded(dtype, o)
        lse = lse.astype(np.float32).astype(np.float64)
        got_o, got_lse = ba.merge_state(backend.array(o[:, 0], dtype), backend.array(lse[:, 0], "float32"),
                                        backend.array(o[:, 1], dtype), backend.array(lse[:, 1], "float32"),
                                        backend=backend.name)
        want_o, want_lse = ref_merge_state(o[:, 0], lse[:, 0], o[:, 1], lse[:, 1])
        assert_close(backend.numpy(got_o), want_o, "merge", dtype, name=f"{backend.name} merge_state o")
        assert_close(backend.numpy(got_lse), want_lse, "merge", "float32", name=f"{backend.name} merge_state lse")

    check()


def test_merge_states(backend):
    from bsrattn.reference import merge_states as ref_merge_states

    @backend.examples()
    @given(partial_states(max_states=7), st.sampled_from([d for d in backend.dtypes if d != "float64"]))
    def check(states, dtype):
        o, lse = states
        (o,) = _rounded(dtype, o)
        lse = lse.astype(np.float32).astype(np.float64)
        got_o, got_lse = ba.merge_states(backend.array(o, dtype), backend.array(lse, "float32"), backend=backend.name)
        want_o, want_lse = ref_merge_states(o, lse)
        assert_close(backend.numpy(got_o), want_o, "merge", dtype, name=f"{backend.name} merge_states o")
        assert_close(backend.numpy(got_lse), want_lse, "merge", "float32", name=f"{backend.name} merge_states lse")

    check()


def test_merge_with_empty_states(backend):
    o = np.arange(12, dtype=np.float64).reshape(1, 3, 4) / 7
    lse = np.array([[0.5, -2.0, 3.0]])
    zero, dead = np.zeros_like(o), np.full_like(lse, -np.inf)
    got_o, got_lse = ba.merge_state(*(backend.array(x, "float32") for x in (o, lse, zero, dead)),
                                    backend=backend.name)
    np.testing.assert_array_equal(backend.numpy(got_o), o.astype(np.float32))
    np.testing.assert_array_equal(backend.numpy(got_lse), lse.astype(np.float32))
    got_o, got_lse = ba.merge_state(*(backend.array(x, "float32") for x in (zero, dead, zero, dead)),
                                    backend=backend.name)
    assert (backend.numpy(got_o) == 0).all() and (backend.numpy(got_lse) == -np.inf).all()
