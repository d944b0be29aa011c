"""Cross-tier tests: every tier, through the public API and the backend flag, against the float64 oracle.

One fixture, ``backend``, runs each test on ``"reference"``, ``"numba"`` and ``"torch"``; a tier whose
package is missing or not built here is skipped with the reason. Inputs are drawn in float64, rounded
through the dtype under test, handed to the tier in its own array kind (torch tensors on CUDA when there is
a GPU, else on the CPU for the Triton interpreter; NumPy for numba, which runs under the CUDA simulator
without a GPU), and compared with the oracle of ``helpers.py`` — attention rebuilt from the layout
constructor's raw inputs, in float64, on the same rounded values; no tier, the reference included, is its own
yardstick — within the error budget of the dtype (``bsrattn.testing``). Merges are compared with
``helpers.naive_merge``, the ⊕ of many states written in one step.

The simulator runs each CUDA thread as a Python thread and the interpreter is slow too, so the non-reference
tiers draw few, tiny examples (``TIER_EXAMPLES``). Real sizes run in ``test_tiers_gpu.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bsrattn as ba
from bsrattn.testing import assert_close
from helpers import NUMPY_DTYPES, as_float64, check_attention, naive_merge, raw_tensors, rotate, rounded
from strategies import EDGE_CASES, LAYOUT_STRATEGIES, Problem, named_case, paged_problem, partial_states, problems

TIERS = ("reference", "numba", "torch")
CORE_TIERS = ("numba-core", "torch-core")
"""The GPU tiers' cores (``kernel="core"``): the paper's kernel at teaching size, held to the attention tests."""
# dtypes each tier is checked in here (no GPU needed); bf16 and fp8 on the GPU tiers run in test_tiers_gpu.py.
TIER_DTYPES = {
    "reference": ("float64", "float32", "float16", "bfloat16"),
    "numba": ("float32", "float16"),
    "torch": ("float32", "float16"),
    "numba-core": ("float32", "float16"),
    "torch-core": ("float32", "float16"),
}
# Hypothesis examples per property on the slow tiers (None: the profile's default).
TIER_EXAMPLES = {"reference": None, "numba": 6, "torch": 6, "numba-core": 4, "torch-core": 4}
# Per layout kind (8 kinds), the slow tiers draw fewer still.
TIER_EXAMPLES_PER_KIND = {"reference": None, "numba": 2, "torch": 2, "numba-core": 2, "torch-core": 2}


def feature_dtypes(tier) -> tuple:
    """The dtypes a test of one feature (scales, sinks, fused RoPE) loops over: every one on the reference, the
    first on the emulated tiers, whose every dtype the property tests sample (an emulated call takes seconds)."""
    return tier.dtypes if tier.name == "reference" else tier.dtypes[:1]


_TIER_DEPENDENCIES = {"numba": ("numba",), "torch": ("torch", "triton")}


@dataclass
class Tier:
    """A loaded tier and how to move arrays to and from the kind it runs on."""

    name: str
    backend: ba.Backend

    @property
    def kind(self) -> str:
        """The tier the name runs on (``"numba"`` for ``"numba-core"``): what its arrays must be."""
        return self.backend.name

    @property
    def dtypes(self) -> tuple:
        return TIER_DTYPES[self.name]

    def examples(self, per_kind=False, budgets=None):
        """A Hypothesis settings decorator with this tier's example budget (of ``budgets``, a table like
        ``TIER_EXAMPLES``, when given)."""
        n = (budgets or (TIER_EXAMPLES_PER_KIND if per_kind else TIER_EXAMPLES))[self.name]
        return settings(max_examples=n) if n else settings()

    def array(self, x, dtype: str):
        """NumPy values -> this tier's array kind in ``dtype`` (torch: a tensor on CUDA if present, else CPU)."""
        x = np.ascontiguousarray(np.asarray(x).astype(NUMPY_DTYPES[dtype]))
        if self.kind != "torch":
            return x
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        wide = np.float64 if dtype == "float64" else np.float32
        return torch.from_numpy(x.astype(wide)).to(device=device, dtype=getattr(torch, dtype))

    def native(self, x, dtype: str):
        """Like :meth:`array`, but in the kind the tier runs on: a Numba device array for numba."""
        if self.kind != "numba":
            return self.array(x, dtype)
        from numba import cuda

        return cuda.to_device(self.array(x, dtype))

    @staticmethod
    def numpy(x) -> np.ndarray:
        """Any tier's output as float64 NumPy."""
        return as_float64(x)


def load_tier(name: str) -> Tier:
    """The tier ``name`` (``"numba-core"``: the numba tier's core kernel), or a pytest skip saying why it cannot load
    here."""
    tier, _, kernel = name.partition("-")
    try:
        return Tier(name, ba.get_backend(tier, kernel or None))
    except ba.BackendError as err:
        pytest.skip(f"{name} tier unavailable: {err}")
    except ModuleNotFoundError as err:
        ours = err.name == ba.backends.REGISTRY[tier] or (err.name or "").split(".")[0] in _TIER_DEPENDENCIES[tier]
        if not ours:
            raise
        pytest.skip(f"{name} tier not built here: {err}")


@pytest.fixture(scope="module", params=TIERS + CORE_TIERS)
def backend(request) -> Tier:
    """Each tier, and each GPU tier's core: what attention runs on."""
    return load_tier(request.param)


@pytest.fixture(scope="module", params=TIERS)
def merging(request) -> Tier:
    """Each tier: what merges run on (a core runs its tier's merges)."""
    return load_tier(request.param)


def plan_heads(problem):
    """Head counts as the call sees them (Quest's per-head views: G query heads over one KV head)."""
    if problem.case.kind == "quest":
        return problem.num_qo_heads // problem.num_kv_heads, 1
    return problem.num_qo_heads, problem.num_kv_heads


def attention_call(tier, problem, dtype):
    """``ba.attention`` on the tier, as a run for ``helpers.check_attention``."""
    sigmoid = problem.variant.use_sigmoid

    def run(q, k, v, kv_layout):
        got = ba.attention(*(tier.array(x, dtype) for x in (q, k, v)), problem.case.layout, variant=problem.variant,
                           kv_layout=kv_layout, backend=tier.backend, return_lse=not sigmoid)
        return (got, None) if sigmoid else got
    return run


# ---- one-shot attention -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(LAYOUT_STRATEGIES))
def test_attention_every_layout(backend, kind):
    @backend.examples(per_kind=True)
    @given(problems([kind]), st.sampled_from(backend.dtypes))
    def check(problem, dtype):
        check_attention(attention_call(backend, problem, dtype), problem, dtype, name=f"{backend.name} {kind}")

    check()


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_attention_edge_cases(backend, name):
    problem = EDGE_CASES[name]
    check_attention(attention_call(backend, problem, "float32"), problem, "float32", name=f"{backend.name} {name}")


def test_attention_any_layout_any_dtype(backend):
    @backend.examples()
    @given(problems(), st.sampled_from(backend.dtypes))
    def check(problem, dtype):
        check_attention(attention_call(backend, problem, dtype), problem, dtype, name=backend.name)

    check()


def test_masked_rows_are_zero_with_minus_inf_lse(backend):
    problem = EDGE_CASES["every key masked (causal, qo_len > kv_len)"]
    out, lse = check_attention(attention_call(backend, problem, "float32"), problem, "float32", name=backend.name)
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
    """``BatchAttention`` planned once and run ``runs`` times, as a run for ``helpers.check_attention``; the
    runs must agree bit for bit."""
    hq, hkv = plan_heads(problem)
    attn = ba.BatchAttention(backend=tier.backend)
    sigmoid = problem.variant.use_sigmoid

    def run(q, k, v, kv_layout):
        attn.plan(problem.case.layout, hq, hkv, problem.head_dim, variant=problem.variant, q_dtype=dtype,
                  kv_dtype=dtype, kv_layout=kv_layout, **options)
        args = [tier.array(x, dtype) for x in (q, k, v)]
        results = [attn.run(*args, return_lse=not sigmoid) for _ in range(runs)]
        results = [(r, None) if sigmoid else r for r in results]
        for other in results[1:]:
            for a, b in zip(results[0], other):
                if a is not None:
                    np.testing.assert_array_equal(tier.numpy(a), tier.numpy(b), err_msg="same plan, different bits")
        return results[0]
    return run, attn


def test_batch_attention_any_layout(backend):
    @backend.examples()
    @given(problems(), st.sampled_from(backend.dtypes), plan_options())
    def check(problem, dtype, options):
        run, _ = batch_call(backend, problem, dtype, options)
        check_attention(run, problem, dtype, name=f"{backend.name} {options}")

    check()


@pytest.mark.parametrize("options", [dict(num_ctas=4), dict(num_ctas=3, fixed_split_size=5),
                                     dict(num_ctas=2, disable_split_kv=True)],
                         ids=["balanced-splits", "fixed_split_size", "disable_split_kv"])
def test_batch_attention_split_modes(backend, options):
    problem = paged_problem()
    run, attn = batch_call(backend, problem, "float32", options)
    check_attention(run, problem, "float32", name=f"{backend.name} {options}")
    (work_plan,) = attn.work_plans
    assert (work_plan.num_merges > 0) == (not options.get("disable_split_kv", False))


@pytest.mark.parametrize("plan", [None, dict(num_ctas=3, fixed_split_size=5)], ids=["one-shot", "split plan"])
def test_kv_scales_on_any_kv_dtype(backend, plan):
    """``k_scale``/``v_scale`` with float KV (not only fp8): the scores are those of ``k * k_scale`` and the
    output is made of ``v * v_scale``, through a one-shot call and a split plan alike."""
    problem = paged_problem()
    scales = dict(k_scale=0.6, v_scale=1.7)
    for dtype in feature_dtypes(backend):
        if plan is None:
            def run(q, k, v, kv_layout):
                return ba.attention(*(backend.array(x, dtype) for x in (q, k, v)), problem.case.layout,
                                    variant=problem.variant, kv_layout=kv_layout, backend=backend.backend,
                                    return_lse=True, **scales)
        else:
            attn = ba.BatchAttention(backend=backend.backend)

            def run(q, k, v, kv_layout):
                attn.plan(problem.case.layout, problem.num_qo_heads, problem.num_kv_heads, problem.head_dim,
                          variant=problem.variant, kv_layout=kv_layout, **plan)
                return attn.run(*(backend.array(x, dtype) for x in (q, k, v)), return_lse=True, **scales)
        check_attention(run, problem, dtype, **scales, name=f"{backend.name} {dtype} scaled KV")


SINKS = (0.7, -1.5, 2.5, 0.0)
"""One attention-sink logit per query head of the problems below (4 query heads): above, below and beside the
scores, which are of order 1."""


@pytest.mark.parametrize("how", ["one-shot", "split plan", "cascade", "empty row"])
def test_attention_sinks_join_the_denominator_once(backend, how):
    """A sink joins each head's softmax denominator once, however the row is cut (split chunks, cascade levels)
    and even with no visible key (out 0, lse the sink), through ``ba.attention`` and ``BatchAttention`` alike."""
    base = EDGE_CASES["shared prefix, empty suffix"] if how == "cascade" else (
        EDGE_CASES["empty row"] if how == "empty row" else paged_problem())
    problem = replace(base, variant=replace(base.variant, sinks=SINKS[:base.num_qo_heads]))
    for dtype in feature_dtypes(backend):
        if how in ("one-shot", "empty row"):
            check_attention(attention_call(backend, problem, dtype), problem, dtype, name=f"{backend.name} {how}")
        run, attn = batch_call(backend, problem, dtype, dict(num_ctas=3, fixed_split_size=4))
        check_attention(run, problem, dtype, name=f"{backend.name} {how} planned")
        assert how == "empty row" or any(p.num_merges for p in attn.work_plans), "the plan must split rows"


ROPE = {"rope": ba.Variant(causal=True, rope_theta=500.0),
        "rope, scaled, with ALiBi and a soft cap": ba.Variant(causal=True, rope_theta=1e4, rope_scale=4.0,
                                                              alibi_slopes=(0.5, 0.25, 0.125, 0.0625),
                                                              logits_soft_cap=5.0)}


@pytest.mark.parametrize("rows", ["decode and append", "prefill"])
@pytest.mark.parametrize("name", sorted(ROPE))
def test_fused_rope(backend, name, rows):
    """Fused RoPE turns ``q`` and ``k`` at their logical positions before the scores (``Variant`` step 0), the
    same through a one-shot call and through a split plan whose chunks start at other positions."""
    raw = dict(qo_lens=[12, 9, 11]) if rows == "prefill" else {}
    problem = paged_problem(ROPE[name], **raw)
    for dtype in feature_dtypes(backend):
        check_attention(attention_call(backend, problem, dtype), problem, dtype, name=f"{backend.name} {name}")
        run, attn = batch_call(backend, problem, dtype, dict(num_ctas=3, fixed_split_size=8))
        check_attention(run, problem, dtype, name=f"{backend.name} {name} split plan")
        assert attn.work_plans[0].num_merges > 0, "the plan must split rows"


SHARED_PREFIX = dict(qo_lens=[3, 1, 2], prefix_pages=[1, 0], prefix_len=7, suffix_page_tables=[[2, 5, 6], [3], [4]],
                     suffix_lens=[9, 2, 4], page_size=4, num_pages=7)
"""A prefix of 7 keys shared by three requests, then suffixes of 9, 2 and 4 keys with prefill rows."""


@pytest.mark.parametrize("variant", [ba.Variant(causal=True, rope_theta=500.0),
                                     ba.Variant(causal=True, rope_theta=1e4, rope_scale=4.0, logits_soft_cap=5.0,
                                                sinks=SINKS)], ids=["rope", "scaled rope, soft cap, sinks"])
def test_fused_rope_on_a_cascade(backend, variant):
    """A Cascade's levels turn queries and keys at their positions in the whole sequence (``Cascade.rope_positions``):
    the shared prefix's keys from 0, each suffix's after it, every query at its own position in both levels."""
    problem = Problem(named_case("shared_prefix", SHARED_PREFIX), 4, 2, 8, variant, seed=5)
    for dtype in feature_dtypes(backend):
        check_attention(attention_call(backend, problem, dtype), problem, dtype, name=f"{backend.name} cascade")
        run, attn = batch_call(backend, problem, dtype, dict(num_ctas=3, fixed_split_size=3))
        check_attention(run, problem, dtype, name=f"{backend.name} cascade, split plan")
        assert len(attn.work_plans) == 2 and all(p.num_merges for p in attn.work_plans), "both levels must split"


def test_fused_rope_at_given_positions(backend):
    """``rope_positions`` turns a BSRLayout's queries and keys where the caller says (FlashInfer's q/k RoPE
    offsets: here queries 8 and 9 positions past their rows' keys, where the layout's own positions put them at
    the last keys; RoPE depends on ``q_pos - k_pos`` only): the same as rotating the inputs there first (float64,
    from the definition) and attending without RoPE."""
    layout = ba.layouts.ragged([3, 1], [7, 5])
    variant = ba.Variant(causal=True, rope_theta=100.0)
    positions = (np.array([104, 105, 106, 13]), np.array([90, 0]))
    k_pos = np.concatenate([90 + np.arange(7), np.arange(5)])
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((4, 4, 8)), rng.standard_normal((12, 2, 8)), rng.standard_normal((12, 2, 8))
    for dtype in feature_dtypes(backend):
        q_r, k_r, v_r = (x.astype(NUMPY_DTYPES[dtype]).astype(np.float64) for x in (q, k, v))
        want = ba.attention(rotate(q_r, positions[0][:, None], variant, "float64"),
                            rotate(k_r, k_pos[:, None], variant, "float64"), v_r, layout,
                            variant=ba.Variant(causal=True), backend="reference")
        args = [backend.array(x, dtype) for x in (q_r, k_r, v_r)]
        got = ba.attention(*args, layout, variant=variant, backend=backend.backend, rope_positions=positions)
        assert_close(backend.numpy(got), want, "attention", dtype, name=f"{backend.name} {dtype} one-shot")
        attn = ba.BatchAttention(backend.backend)
        attn.plan(layout, 4, 2, 8, variant=variant, num_ctas=3, fixed_split_size=2, rope_positions=positions)
        assert attn.work_plans[0].num_merges > 0, "the plan must split rows"
        assert_close(backend.numpy(attn.run(*args)), want, "attention", dtype, name=f"{backend.name} {dtype} split")


def test_batch_attention_cascade(backend):
    problem = EDGE_CASES["shared prefix, empty suffix"]
    for options in (dict(num_ctas=4), dict(num_ctas=2, fixed_split_size=3)):
        run, attn = batch_call(backend, problem, "float32", options)
        check_attention(run, problem, "float32", name=f"{backend.name} {options}")
        assert len(attn.work_plans) == 2 and attn.work_plans[0].num_merges > 0


def test_run_writes_out_and_lse_buffers(backend):
    problem = paged_problem()
    attn = ba.BatchAttention(backend=backend.backend)
    attn.plan(problem.case.layout, 4, 2, 8, variant=problem.variant, q_dtype="float32", kv_dtype="float32")

    def run(q, k, v, kv_layout):
        out = backend.array(np.zeros(q.shape), "float32")
        lse = backend.array(np.zeros(q.shape[:2]), "float32")
        got_o, got_lse = attn.run(*(backend.array(x, "float32") for x in (q, k, v)), out=out, lse=lse,
                                  return_lse=True)
        np.testing.assert_array_equal(backend.numpy(got_o), backend.numpy(out))
        np.testing.assert_array_equal(backend.numpy(got_lse), backend.numpy(lse))
        return out, lse

    check_attention(run, problem, "float32", name=f"{backend.name} out= and lse= buffers")


def test_returns_the_array_kind_it_was_given(backend):
    problem = paged_problem()
    q, k, v = raw_tensors(problem, "float32")
    layout = problem.case.layout
    native_q = backend.native(q, "float32")
    native = ba.attention(native_q, *(backend.native(x, "float32") for x in (k, v)), layout, backend=backend.backend)
    from_numpy = ba.attention(*(x.astype(np.float32) for x in (q, k, v)), layout, backend=backend.backend)
    assert isinstance(from_numpy, np.ndarray) and from_numpy.dtype == np.float32
    assert type(native) is type(native_q)
    np.testing.assert_array_equal(backend.numpy(native), backend.numpy(from_numpy))


# ---- merge through the flag ---------------------------------------------------------------------------

def test_merge_state(merging):
    @merging.examples()
    @given(partial_states(min_states=2, max_states=2), st.sampled_from([d for d in merging.dtypes if d != "float64"]))
    def check(states, dtype):
        o, lse = rounded(states[0], dtype), rounded(states[1], "float32")
        got_o, got_lse = ba.merge_state(merging.array(o[:, 0], dtype), merging.array(lse[:, 0], "float32"),
                                        merging.array(o[:, 1], dtype), merging.array(lse[:, 1], "float32"),
                                        backend=merging.backend)
        want_o, want_lse = naive_merge(o, lse)
        assert_close(merging.numpy(got_o), want_o, "merge", dtype, name=f"{merging.name} merge_state o")
        assert_close(merging.numpy(got_lse), want_lse, "merge", "float32", name=f"{merging.name} merge_state lse")

    check()


def test_merge_states(merging):
    @merging.examples()
    @given(partial_states(max_states=7), st.sampled_from([d for d in merging.dtypes if d != "float64"]))
    def check(states, dtype):
        o, lse = rounded(states[0], dtype), rounded(states[1], "float32")
        got_o, got_lse = ba.merge_states(merging.array(o, dtype), merging.array(lse, "float32"), backend=merging.backend)
        want_o, want_lse = naive_merge(o, lse)
        assert_close(merging.numpy(got_o), want_o, "merge", dtype, name=f"{merging.name} merge_states o")
        assert_close(merging.numpy(got_lse), want_lse, "merge", "float32", name=f"{merging.name} merge_states lse")

    check()


def test_merge_of_large_lses_does_not_overflow(merging):
    """The max shift: float32 ``exp`` overflows past 88; the states' LSEs are near 1000."""
    o_a, o_b = np.full((2, 1, 4), 1.0), np.full((2, 1, 4), 5.0)
    lse_a, lse_b = np.array([[1000.0], [-1000.0]]), np.array([[1000.0 + np.log(3.0)], [-1000.0 + np.log(3.0)]])
    got_o, got_lse = ba.merge_state(*(merging.array(x, "float32") for x in (o_a, lse_a, o_b, lse_b)),
                                    backend=merging.backend)
    want_o, want_lse = naive_merge(np.stack([o_a, o_b], 1), rounded(np.stack([lse_a, lse_b], 1), "float32"))
    assert_close(merging.numpy(got_o), want_o, "merge", "float32", name=f"{merging.name} merged o")
    assert_close(merging.numpy(got_lse), want_lse, "merge", "float32", name=f"{merging.name} merged lse")


def test_merge_with_empty_states(merging):
    o = np.arange(12, dtype=np.float64).reshape(1, 3, 4) / 7
    lse = np.array([[0.5, -2.0, 3.0]])
    zero, dead = np.zeros_like(o), np.full_like(lse, -np.inf)
    got_o, got_lse = ba.merge_state(*(merging.array(x, "float32") for x in (o, lse, zero, dead)),
                                    backend=merging.backend)
    np.testing.assert_array_equal(merging.numpy(got_o), o.astype(np.float32))
    np.testing.assert_array_equal(merging.numpy(got_lse), lse.astype(np.float32))
    got_o, got_lse = ba.merge_state(*(merging.array(x, "float32") for x in (zero, dead, zero, dead)),
                                    backend=merging.backend)
    assert (merging.numpy(got_o) == 0).all() and (merging.numpy(got_lse) == -np.inf).all()
