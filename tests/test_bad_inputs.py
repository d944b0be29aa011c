"""Bad input of every kind is refused with an error naming the argument and the value, before a tier runs.

One section per kind of input that once slipped through: floats truncated to ids, lengths wrapping in int32,
states that are not real floats, lists where arrays go, read-only buffers, non-numbers in a Variant, NumPy
scalars accepted in one place and refused in another, tensors without data or on the wrong device, dtypes
the Triton interpreter computes wrongly, dtypes given as objects, and torch tensors on the reference tier.
Cases caught by shared validation go through ``test_validation``'s probe backend, which fails the test if
it is reached; checks that live in a tier run on every tier they apply to.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import bsrattn as ba
from bsrattn import scheduler
from bsrattn.validation import make_spec
from test_validation import LAYOUT, PROBE, arrays, attention, planned

f16, f32 = np.float16, np.float32
TIERS = ("reference", "numba", "torch")


def _backend(name):
    try:
        return ba.get_backend(name)
    except ba.BackendError as err:
        pytest.skip(f"{name} tier unavailable: {err}")


@pytest.fixture(params=TIERS)
def tier(request):
    return _backend(request.param)


def _torch():
    return pytest.importorskip("torch")


def _tensor(x):
    """The NumPy array ``x`` as a CPU tensor of the same dtype, bit for bit (bfloat16 and fp8 included)."""
    torch = _torch()
    bits = {"bfloat16": np.int16, "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8}.get(x.dtype.name)
    return torch.as_tensor(x) if bits is None else torch.as_tensor(x.view(bits)).view(getattr(torch, x.dtype.name))


def _raises(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---- 1. floats where integers go: refused, even integral ones, never truncated ----------------------------

FLOAT_IDS = {
    "paged page table entry": (lambda: ba.layouts.paged([1, 1], [[0], [1.5]], [3, 3], 4, 3),
                               r"page_tables\[1\] must hold integers, got 1\.5$"),
    "paged NaN page id": (lambda: ba.layouts.paged([1], [[np.nan]], [3], 4, 3),
                          r"page_tables\[0\] must hold integers, got nan"),
    "paged integral float page id": (lambda: ba.layouts.paged([1], [[2.0]], [3], 4, 3),
                                     r"page_tables\[0\] must hold integers, got 2\.0 \(floats are refused"),
    "paged None page id": (lambda: ba.layouts.paged([1], [[0, None]], [3], 4, 3),
                           r"page_tables\[0\] must hold integers, got None"),
    "paged kv_lens": (lambda: ba.layouts.paged([1], [[0]], [1.5], 4, 3), r"kv_lens must hold integers, got 1\.5"),
    "paged qo_lens of bools": (lambda: ba.layouts.paged([True], [[0]], [3], 4, 3),
                               r"qo_lens must hold integers, got True"),
    "paged page_size": (lambda: ba.layouts.paged([1], [[0]], [3], 4.0, 3), r"page_size must be an int, got 4\.0"),
    "paged num_pages": (lambda: ba.layouts.paged([1], [[0]], [3], 4, np.float32(3)),
                        r"num_pages must be an int, got np.float32\(3\.0\)"),
    "vector_sparse token": (lambda: ba.layouts.vector_sparse([[1, 1.5]], [1], 4),
                            r"token_indices\[0\] must hold integers, got 1\.5"),
    "vector_sparse num_slots": (lambda: ba.layouts.vector_sparse([[1]], [1], 4.5), r"num_slots must be an int"),
    "block_sparse column block": (lambda: ba.layouts.block_sparse([0, 1], [1.5], 4, 8, 4, 4),
                                  r"indices must hold integers, got 1\.5"),
    "block_sparse indptr": (lambda: ba.layouts.block_sparse([0, 1.0], [1], 4, 8, 4, 4),
                            r"indptr must hold integers, got 0\.0"),
    "block_sparse block height": (lambda: ba.layouts.block_sparse([0, 1], [1], 4, 8, 4.0, 4),
                                  r"R must be an int, got 4\.0"),
    "tree parent": (lambda: ba.layouts.tree([[-1, 0.5]], [[0]], [3], 4, 1), r"parents\[0\] must hold integers"),
    "quest page table": (lambda: ba.layouts.quest([[0, 1.5]], [8], [[[0, 1]]], 4, 2, 1),
                         r"page_tables\[0\] must hold integers, got 1\.5"),
    "quest selected page": (lambda: ba.layouts.quest([[0, 1]], [8], [[[0, 1.5]]], 4, 2, 1),
                            r"selected_pages\[0\]\[0\] must hold integers, got 1\.5"),
    "quest num_kv_heads": (lambda: ba.layouts.quest([[0, 1]], [8], [[[0]]], 4, 2, 1.0),
                           r"num_kv_heads must be an int"),
    "shared_prefix prefix page": (lambda: ba.layouts.shared_prefix([1], [0.5], 4, [[1]], [2], 4, 3),
                                  r"prefix_pages must hold integers, got 0\.5"),
    "shared_prefix prefix_len": (lambda: ba.layouts.shared_prefix([1], [0], 4.0, [[1]], [2], 4, 3),
                                 r"prefix_len must be an int, got 4\.0"),
    "shared_prefix suffix page": (lambda: ba.layouts.shared_prefix([1, 1], [0], 4, [[1], [2.5]], [2, 1], 4, 3),
                                  r"suffix_page_tables\[1\] must hold integers, got 2\.5"),
    "shared_prefix suffix length": (lambda: ba.layouts.shared_prefix([1], [0], 4, [[1]], [1.5], 4, 3),
                                    r"suffix_lens must hold integers, got 1\.5"),
    "ragged length": (lambda: ba.layouts.ragged([1], [1.5]), r"kv_lens must hold integers, got 1\.5"),
    "dense length": (lambda: ba.layouts.dense(1.5, 3), r"qo_len must be an int, got 1\.5"),
    "BSRLayout kv_last_len": (lambda: ba.BSRLayout([0, 1], [0, 1], [0], [1.5], 4, 3),
                              r"kv_last_len must hold integers, got 1\.5"),
    "BSRLayout string index": (lambda: ba.BSRLayout([0, 1], [0, 1], ["0"], [1], 4, 3),
                               r"kv_indices must hold integers, got '0'"),
    "BSRLayout block_size": (lambda: ba.BSRLayout([0, 1], [0, 1], [0], [1], 4.0, 3),
                             r"block_size must be an int, got 4\.0"),
    "scheduler length": (lambda: scheduler.plan([1], [2.0], num_ctas=2), r"kv_lens must hold integers, got 2\.0"),
}


@pytest.mark.parametrize("name", list(FLOAT_IDS))
def test_floats_are_refused_where_integers_go(name):
    call, match = FLOAT_IDS[name]
    _raises(call, TypeError, match)


def test_numpy_integers_are_accepted_where_ints_go():
    want = ba.layouts.paged([1, 2], [[2, 0], [1]], [7, 3], 4, 3)
    got = ba.layouts.paged(np.array([1, 2], np.int32), [np.array([2, 0], np.uint8), [1]], np.array([7, 3]),
                           np.int64(4), np.int32(3))
    for field in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_len"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
    assert type(got.block_size) is int and type(got.num_blocks) is int
    assert ba.layouts.dense(np.int64(2), np.int32(5)).kv_lens.tolist() == [5]


# ---- 2. lengths and sizes that do not fit int32: refused, never wrapped or allocated --------------------

def test_a_row_longer_than_int32_is_refused_not_wrapped():
    """2**20 + 1 blocks of 4096 slots: (nblocks - 1) * block_size + last in int32 would wrap to 4096."""
    blocks = 2**20 + 1
    with pytest.raises(ValueError, match=r"row 0 has kv_len 4294971392 \(1048577 blocks of block_size=4096\), "
                                         r"more than int32"):
        ba.BSRLayout([0, 1], [0, blocks], np.zeros(blocks, np.int32), [4096], 4096, 1)
    with pytest.raises(ValueError, match=r"row 1 has kv_len 4294971392"):
        ba.layouts.block_sparse([0, 0, blocks], np.zeros(blocks, np.int32), M=2, N=4096, R=1, C=4096)


SIZES = {
    "a length over int32": (lambda: ba.layouts.ragged([1], [2**31]),
                            r"kv_lens must fit in int32 .*, got kv_lens\[0\]=2147483648"),
    "lengths summing over int32": (lambda: ba.layouts.ragged([1, 1], [2**30, 2**30]),
                                   r"kv_lens sum to 2147483648, more than int32"),
    "a Python int beyond int64": (lambda: ba.layouts.ragged([1], [2**70]), r"kv_lens must fit in int32"),
    "tree masks over int32": (lambda: ba.layouts.tree([[-1] * 2**15], [[0] * 16], [2**16], 2**12, 1),
                              r"tree masks' sizes .* sum to 2147483648"),
    "scheduler num_ctas": (lambda: scheduler.plan([1], [4], num_ctas=2**31),
                           r"num_ctas must be <= 1048576 \(2\*\*20\), got 2147483648: a launch runs"),
    "plan num_ctas": (lambda: planned(num_ctas=2**31), r"num_ctas must be <= 1048576"),
    "plan fixed_split_size": (lambda: planned(fixed_split_size=2**31),
                              r"fixed_split_size must be <= 2147483647, got 2147483648"),
    "round_robin num_ctas": (lambda: scheduler.round_robin([1], [4], num_ctas=2**21), r"num_ctas must be <= 1048576"),
}


@pytest.mark.parametrize("name", list(SIZES))
def test_sizes_beyond_int32_are_refused_before_anything_is_allocated(name):
    call, match = SIZES[name]
    _raises(call, ValueError, match)


# ---- 3. states that are not real floats -----------------------------------------------------------------

def _states(o_dtype=f32, lse_dtype=f32):
    return np.ones((2, 3, 4), o_dtype), np.zeros((2, 3), lse_dtype)


@pytest.mark.parametrize("dtype", [np.int64, np.bool_, np.complex64])
@pytest.mark.parametrize("position", ["o_a", "lse_a", "o_b", "lse_b"])
def test_merge_state_refuses_states_that_are_not_real_floats(tier, dtype, position):
    o, lse = _states()
    args = dict(o_a=o, lse_a=lse, o_b=o, lse_b=lse)
    args[position] = args[position].astype(dtype)
    name = np.dtype(dtype).name
    with pytest.raises(TypeError, match=rf"^{position} has dtype {name}; attention states are real floats"):
        ba.merge_state(*args.values(), backend=tier)


@pytest.mark.parametrize("position", ["o", "lse"])
def test_merge_states_refuses_states_that_are_not_real_floats(tier, position):
    args = dict(o=np.ones((2, 3, 1, 4), f32), lse=np.zeros((2, 3, 1), f32))
    args[position] = args[position].astype(np.int32)
    with pytest.raises(TypeError, match=rf"^{position} has dtype int32"):
        ba.merge_states(*args.values(), backend=tier)


def test_merge_state_refuses_torch_integer_and_complex_states(tier):
    torch = _torch()
    o, lse = (torch.as_tensor(x) for x in _states())
    for bad in (o.to(torch.int32), o.to(torch.complex64)):
        with pytest.raises(TypeError, match=r"^o_b has dtype (int32|complex64)"):
            ba.merge_state(o, lse, bad, lse, backend=tier)


# ---- 4. lists and None where arrays go ------------------------------------------------------------------

NOT_ARRAYS = {
    "q a list": (lambda be: ba.attention(arrays()[0].tolist(), *arrays()[1:], LAYOUT, backend=be), "q", "list"),
    "k None": (lambda be: ba.attention(arrays()[0], None, arrays()[2], LAYOUT, backend=be), "k", "NoneType"),
    "v a list": (lambda be: ba.attention(*arrays()[:2], arrays()[2].tolist(), LAYOUT, backend=be), "v", "list"),
    "out a list": (lambda be: ba.attention(*arrays(), LAYOUT, out=[0.0], backend=be), "out", "list"),
    "lse a tuple": (lambda be: ba.attention(*arrays(), LAYOUT, lse=(0.0,), backend=be), "lse", "tuple"),
    "run q a list": (lambda be: _planned_on(be).run(arrays()[0].tolist(), *arrays()[1:]), "q", "list"),
    "o_a a list": (lambda be: ba.merge_state([[[1.0]]], *_states()[1:], *_states(), backend=be), "o_a", "list"),
    "lse_b None": (lambda be: ba.merge_state(*_states(), _states()[0], None, backend=be), "lse_b", "NoneType"),
    "merge_states o a list": (lambda be: ba.merge_states([1.0], np.zeros((1, 1, 1)), backend=be), "o", "list"),
}


def _planned_on(backend):
    attn = ba.BatchAttention(backend=backend)
    attn.plan(LAYOUT, 4, 2, 8)
    return attn


@pytest.mark.parametrize("name", list(NOT_ARRAYS))
def test_non_arrays_are_refused_naming_the_argument(tier, name):
    call, arg, kind = NOT_ARRAYS[name]
    with pytest.raises(TypeError, match=rf"^{arg} must be an array \(NumPy, torch tensor, or a device array\), "
                                        rf"got {kind}$"):
        call(tier)


# ---- 5. read-only buffers -------------------------------------------------------------------------------

def _read_only(x):
    x.flags.writeable = False
    return x


@pytest.mark.parametrize("buffer", ["out", "lse"])
def test_read_only_buffers_are_refused(tier, buffer):
    q = arrays()[0]
    bufs = dict(out=np.zeros(q.shape, f32), lse=np.zeros(q.shape[:2], f32))
    bufs[buffer] = _read_only(bufs[buffer])
    with pytest.raises(ValueError, match=rf"^{buffer} is read-only"):
        ba.attention(*arrays(), LAYOUT, backend=tier, return_lse=True, **bufs)
    with pytest.raises(ValueError, match=rf"^{buffer} is read-only"):
        _planned_on(tier).run(*arrays(), return_lse=True, **bufs)


# ---- 6. Variant fields, and NumPy scalars wherever Python numbers go ------------------------------------

VARIANT_FIELDS = {
    "sm_scale a string": (dict(sm_scale="a"), r"sm_scale must be a real number, got 'a'"),
    "soft cap None": (dict(logits_soft_cap=None), r"logits_soft_cap must be a real number, got None"),
    "sigmoid bias a list": (dict(sigmoid_bias=[1]), r"sigmoid_bias must be a real number, got \[1\]"),
    "alibi slopes a string": (dict(alibi_slopes="x"), r"alibi_slopes must be a sequence of real numbers, got 'x'"),
    "alibi slopes ragged": (dict(alibi_slopes=[[1.0], [1.0, 2.0]]), r"alibi_slopes must be a sequence of real"),
    "alibi slopes of bools": (dict(alibi_slopes=[True]), r"alibi_slopes must be a sequence of real numbers"),
    "sm_scale a bool": (dict(sm_scale=True), r"sm_scale must be a real number, got True"),
    "window_left a float": (dict(window_left=2.0), r"window_left must be an int, got 2\.0"),
    "sinks a string": (dict(sinks="x"), r"sinks must be a sequence of real numbers, got 'x'"),
    "rope_theta a string": (dict(rope_theta="1e4"), r"rope_theta must be a real number, got '1e4'"),
    "rope_scale None": (dict(rope_theta=1e4, rope_scale=None), r"rope_scale must be a real number, got None"),
}


@pytest.mark.parametrize("name", list(VARIANT_FIELDS))
def test_variant_fields_must_be_numbers(name):
    kwargs, match = VARIANT_FIELDS[name]
    _raises(lambda: ba.Variant(**kwargs), TypeError, match)


def test_numpy_scalars_are_accepted_wherever_python_numbers_are():
    variant = ba.Variant(sm_scale=np.float32(0.5), window_left=np.int64(3), logits_soft_cap=np.int64(3),
                         alibi_slopes=np.array([1, 2, 3, 4], np.int32), sigmoid_bias=np.float16(0.25))
    assert variant == ba.Variant(sm_scale=0.5, window_left=3, logits_soft_cap=3.0, alibi_slopes=(1.0, 2.0, 3.0, 4.0),
                                 sigmoid_bias=0.25)
    attn = ba.BatchAttention(backend=PROBE)
    attn.plan(LAYOUT, np.int64(4), np.int32(2), np.int64(8), num_ctas=np.int32(3), fixed_split_size=np.int64(4))
    spec = attn._specs[0]
    assert (spec.num_qo_heads, spec.num_kv_heads, spec.head_dim) == (4, 2, 8)
    assert all(type(x) is int for x in (spec.num_qo_heads, spec.num_kv_heads, spec.head_dim))
    assert attn.work_plans[0].num_ctas == 3
    # An fp8 scale as a NumPy float passes validation: the probe is reached.
    with pytest.raises(AssertionError, match="the backend was called"):
        attention(*arrays(f16, ml_dtypes.float8_e4m3fn), k_scale=np.float32(0.5), v_scale=np.int64(2))


INTS = {
    "plan head_dim a float": (lambda: ba.BatchAttention(backend=PROBE).plan(LAYOUT, 4, 2, 8.0), TypeError,
                              r"head_dim must be an int, got 8\.0"),
    "plan num_kv_heads a bool": (lambda: ba.BatchAttention(backend=PROBE).plan(LAYOUT, 4, True, 8), TypeError,
                                 r"num_kv_heads must be an int, got True"),
    "plan num_ctas a float": (lambda: planned(num_ctas=3.0), TypeError, r"num_ctas must be an int, got 3\.0"),
    "plan fixed_split_size a bool": (lambda: planned(fixed_split_size=True), TypeError,
                                     r"fixed_split_size must be an int, got True"),
    "k_scale a string": (lambda: attention(*arrays(f16, ml_dtypes.float8_e5m2), k_scale="1"), TypeError,
                         r"k_scale must be a real number, got '1'"),
    "v_scale a bool": (lambda: attention(*arrays(f16, ml_dtypes.float8_e5m2), v_scale=True), TypeError,
                       r"v_scale must be a real number, got True"),
}


@pytest.mark.parametrize("name", list(INTS))
def test_numbers_of_the_wrong_kind_are_refused(name):
    _raises(*INTS[name])


def test_a_replan_with_equal_but_invalid_arguments_is_checked_again():
    """plan() skips re-validation for the very objects of the last step, never for merely equal ones."""
    attn = planned()
    with pytest.raises(TypeError, match=r"num_qo_heads must be an int, got 4\.0"):
        attn.plan(LAYOUT, 4.0, 2, 8)


def test_a_replan_with_the_same_arguments_does_not_validate_them_again(monkeypatch):
    from bsrattn import api

    attn = planned()
    monkeypatch.setattr(api, "make_spec", lambda *a, **k: pytest.fail("make_spec ran for checked arguments"))
    attn.plan(LAYOUT, 4, 2, 8)



def _read_only_out():
    q = arrays()[0]
    return dict(out=_read_only(np.zeros(q.shape, f32)))


# After a call that passed, ``run`` skips the checks for arguments like its own; each of these differs from it
# in one thing the checks read, and must be refused as by a fresh plan.
AFTER_A_GOOD_CALL = {
    "q of another shape": lambda q, k, v: ((q[:2], k, v), {}),
    "q of another dtype": lambda q, k, v: ((q.astype(f16), k, v), {}),
    "k of another dtype": lambda q, k, v: ((q, k.astype(f16), v), {}),
    "v of another shape": lambda q, k, v: ((q, k, v[:2]), {}),
    "out of another dtype": lambda q, k, v: ((q, k, v), dict(out=np.zeros(q.shape, f16))),
    "out read-only": lambda q, k, v: ((q, k, v), _read_only_out()),
    "lse of another shape": lambda q, k, v: ((q, k, v), dict(lse=np.zeros(q.shape, f32))),
    "k_scale True": lambda q, k, v: ((q, k, v), dict(k_scale=True)),
    "v_scale 0": lambda q, k, v: ((q, k, v), dict(v_scale=0.0)),
    "k a list": lambda q, k, v: ((q, k.tolist(), v), {}),
}


@pytest.mark.parametrize("name", list(AFTER_A_GOOD_CALL))
def test_run_checks_again_whatever_differs_from_the_last_call_that_passed(name):
    q, k, v = arrays()
    good = dict(out=np.zeros(q.shape, f32), lse=np.zeros(q.shape[:2], f32), k_scale=1, v_scale=1.0)
    args, changed = AFTER_A_GOOD_CALL[name](q, k, v)
    bad = {**good, **changed}
    with pytest.raises((TypeError, ValueError)) as fresh:
        _planned_on("reference").run(*args, **bad)
    attn = _planned_on("reference")
    attn.run(q, k, v, **good)
    with pytest.raises(type(fresh.value), match=f"^{re.escape(str(fresh.value))}$"):
        attn.run(*args, **bad)


@pytest.mark.parametrize("name", list(AFTER_A_GOOD_CALL))
def test_a_one_shot_call_checks_again_whatever_differs_from_the_last_call_that_passed(name, monkeypatch):
    """A one-shot call like the last one that passed (its layout object, variant, view and what the checks read
    of the arguments) skips the checks; each of these differs from it in one thing the checks read, and must be
    refused as by a first call."""
    from bsrattn import api, passed

    monkeypatch.setattr(api, "ONE_SHOT", passed.Passed())
    q, k, v = arrays()
    good = dict(out=np.zeros(q.shape, f32), lse=np.zeros(q.shape[:2], f32), k_scale=1, v_scale=1.0, return_lse=True)
    args, changed = AFTER_A_GOOD_CALL[name](q, k, v)
    bad = {**good, **changed}
    with pytest.raises((TypeError, ValueError)) as fresh:
        ba.attention(*args, LAYOUT, backend="reference", **bad)
    ba.attention(q, k, v, LAYOUT, backend="reference", **good)
    with pytest.raises(type(fresh.value), match=f"^{re.escape(str(fresh.value))}$"):
        ba.attention(*args, LAYOUT, backend="reference", **bad)


def test_a_one_shot_call_like_the_last_that_passed_skips_only_its_checks(monkeypatch):
    """The checks of a one-shot call run once for a layout object, variant and view and the arguments' kinds;
    another layout object (even an equal one), variant or view is checked again."""
    import copy

    from bsrattn import api, passed

    monkeypatch.setattr(api, "ONE_SHOT", passed.Passed())
    checked = []
    real = api.spec_from_inputs
    monkeypatch.setattr(api, "spec_from_inputs", lambda *args, **kwargs: checked.append(1) or real(*args, **kwargs))
    q, k, v = arrays()
    hnd = np.ascontiguousarray(k.transpose(0, 2, 1, 3)), np.ascontiguousarray(v.transpose(0, 2, 1, 3))
    for call, want in ((dict(), 1), (dict(), 1), (dict(variant=ba.Variant(causal=True)), 2), (dict(), 3),
                       (dict(layout=copy.copy(LAYOUT)), 4), (dict(kv=hnd, kv_layout="HND"), 5), (dict(), 6)):
        kv = call.pop("kv", (k, v))
        ba.attention(q, *kv, call.pop("layout", LAYOUT), backend="reference", **call)
        assert len(checked) == want, (call, len(checked))


# ---- 7. tensors without data, or on a device the tier cannot use ----------------------------------------

@pytest.mark.parametrize("arg", ["q", "k", "v", "out", "lse"])
def test_meta_tensors_are_refused_naming_the_argument(tier, arg):
    torch = _torch()
    q, k, v = (torch.as_tensor(x) for x in arrays())
    named = dict(q=q, k=k, v=v, out=torch.empty_like(q), lse=torch.empty(q.shape[:2]))
    named[arg] = named[arg].to("meta")
    with pytest.raises(ValueError, match=rf"^{arg} is on meta, a device that holds no data"):
        ba.attention(named.pop("q"), named.pop("k"), named.pop("v"), LAYOUT, backend=tier, return_lse=True, **named)


@pytest.mark.parametrize("arg", ["o_a", "lse_b"])
def test_meta_states_are_refused(tier, arg):
    torch = _torch()
    args = dict(zip(("o_a", "lse_a", "o_b", "lse_b"), (torch.as_tensor(x) for x in _states() * 2)))
    args[arg] = args[arg].to("meta")
    with pytest.raises(ValueError, match=rf"^{arg} is on meta"):
        ba.merge_state(*args.values(), backend=tier)


def test_torch_device_checks_say_whose_device_and_why():
    torch = _torch()
    from bsrattn.torch_cuda.config import interpreting
    from bsrattn.torch_cuda.arrays import check_device, device_of

    with pytest.raises(ValueError, match=r"cannot run on meta \(the device of the inputs\): a meta tensor holds no"):
        device_of(np.zeros(1), torch.empty(1, device="meta"))
    other = "cuda" if interpreting() else "cpu"
    with pytest.raises(ValueError, match=rf"cannot run on {other}(:0)? \(the device of the inputs\)"):
        check_device(torch.device(other), "the inputs")


@pytest.mark.parametrize("arg", ["q", "out", "o_a"])
def test_numba_refuses_cpu_torch_tensors_it_would_hand_back_as_numpy(arg):
    torch = _torch()
    be = _backend("numba")
    q, k, v = arrays()
    with pytest.raises(TypeError, match=rf"^{arg} is a torch tensor on cpu; the numba tier takes NumPy arrays"):
        if arg == "o_a":
            ba.merge_state(*(torch.as_tensor(x) for x in _states() * 2), backend=be)
        elif arg == "q":
            ba.attention(torch.as_tensor(q), k, v, LAYOUT, backend=be)
        else:
            ba.attention(q, k, v, LAYOUT, backend=be, out=torch.zeros(q.shape))


# ---- 8. dtypes the Triton interpreter computes wrongly --------------------------------------------------

@pytest.fixture
def interpreter():
    _torch()
    from bsrattn.torch_cuda.config import interpreting

    if not interpreting():
        pytest.skip("the refusal applies under TRITON_INTERPRET=1 only; on a GPU bfloat16 runs")


def test_the_interpreter_refuses_bfloat16_attention(interpreter):
    torch = _torch()
    q, k, v = (torch.as_tensor(x) for x in arrays())
    why = r"the Triton interpreter computes bfloat16 arithmetic wrongly; run bfloat16 on a GPU"
    bf16 = [x.to(torch.bfloat16) for x in (q, k, v)]
    with pytest.raises(TypeError, match=rf"^q has dtype bfloat16: {why}"):
        ba.attention(*bf16, LAYOUT, backend="torch")
    with pytest.raises(TypeError, match=rf"^q has dtype bfloat16: {why}"):
        ba.attention(*(x.numpy().astype(ml_dtypes.bfloat16) for x in (q, k, v)), LAYOUT, backend="torch")
    with pytest.raises(TypeError, match=rf"^q has dtype bfloat16: {why}"):
        _planned_on("torch").run(*bf16)
    fp8 = [x.to(torch.float8_e4m3fn) for x in (k, v)]
    with pytest.raises(TypeError, match=rf"^q has dtype bfloat16: {why}"):
        ba.attention(bf16[0], *fp8, LAYOUT, backend="torch")
    from bsrattn.torch_cuda.arrays import to_torch

    with pytest.raises(TypeError, match=rf"^k has dtype bfloat16: {why}"):
        to_torch("k", bf16[1], torch.device("cpu"))


def test_the_interpreter_still_runs_what_it_computes_right(interpreter):
    """fp16 q over fp8 KV (cast to fp16 in the kernel) and bf16 merges (widened to fp32) agree with the
    reference, so they are not refused."""
    torch = _torch()
    from bsrattn.testing import assert_close

    q, k, v = arrays(f16, ml_dtypes.float8_e4m3fn)
    got = ba.attention(*(_tensor(x) for x in (q, k, v)), LAYOUT, backend="torch", k_scale=0.5)
    want = ba.attention(q.astype(np.float64), k.astype(np.float64) * 0.5, v.astype(np.float64), LAYOUT)
    assert_close(got, want, "attention", "float8_e4m3fn")
    o, lse = _states(ml_dtypes.bfloat16)
    got_o, got_lse = ba.merge_state(o, lse, 3 * o, lse + 1, backend="torch")
    want_o, want_lse = ba.merge_state(o.astype(np.float64), lse, 3 * o.astype(np.float64), lse + 1)
    assert_close(got_o, want_o, "merge", "bfloat16")
    assert_close(got_lse, want_lse, "merge", "float32")


# ---- 9. dtype arguments as objects ----------------------------------------------------------------------

def _dtype_forms():
    forms = ["float16", np.float16, np.dtype("float16")]
    try:
        import torch
    except ImportError:
        return forms
    return forms + [torch.float16]


@pytest.mark.parametrize("form", _dtype_forms(), ids=repr)
def test_plan_dtypes_may_be_names_numpy_or_torch_dtypes(form):
    attn = planned(q_dtype=form, kv_dtype=form)
    assert (attn._specs[0].q_dtype, attn._specs[0].kv_dtype) == ("float16", "float16")
    with pytest.raises(TypeError, match=r"q has dtype float32, the plan expects float16"):
        attn.run(*arrays())
    spec = make_spec(LAYOUT, 4, 2, 8, q_dtype=ml_dtypes.bfloat16, kv_dtype=ml_dtypes.float8_e5m2)
    assert (spec.q_dtype, spec.kv_dtype) == ("bfloat16", "float8_e5m2")


def test_an_unsupported_dtype_object_lists_the_supported_names():
    with pytest.raises(TypeError, match=r"q_dtype <class 'numpy.int8'> is not supported; choose from \('float64'"):
        planned(q_dtype=np.int8)


# ---- 10. the reference tier hands torch tensors back as torch tensors -----------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_reference_returns_torch_tensors_of_the_inputs_dtype(dtype):
    torch = _torch()
    q, k, v = arrays(np.dtype(getattr(ml_dtypes, dtype, None) or dtype))
    tq, tk, tv = (_tensor(x) for x in (q, k, v))
    attn = _planned_on("reference")
    for (got_o, got_lse), (want_o, want_lse) in (
            (ba.attention(tq, tk, tv, LAYOUT, return_lse=True), ba.attention(q, k, v, LAYOUT, return_lse=True)),
            (attn.run(tq, tk, tv, return_lse=True), attn.run(q, k, v, return_lse=True))):
        assert isinstance(got_o, torch.Tensor) and got_o.dtype == tq.dtype and got_o.device == tq.device
        assert got_lse.dtype == (torch.float64 if dtype == "float64" else torch.float32)
        # The same values as NumPy inputs give, bit for bit.
        np.testing.assert_array_equal(got_o.float().numpy(), want_o.astype(np.float32))
        np.testing.assert_array_equal(got_lse.numpy(), want_lse)


def test_reference_fp8_kv_and_buffers_as_torch_tensors():
    torch = _torch()
    q, k, v = arrays(f16, ml_dtypes.float8_e4m3fn)
    out, lse = torch.full(q.shape, float("nan"), dtype=torch.float16), torch.empty(q.shape[:2])
    got_o, got_lse = ba.attention(*(_tensor(x) for x in (q, k, v)), LAYOUT, backend="reference", out=out, lse=lse,
                                  return_lse=True, k_scale=0.5)
    want_o, want_lse = ba.attention(q, k, v, LAYOUT, return_lse=True, k_scale=0.5)
    assert got_o is out and got_lse is lse
    np.testing.assert_array_equal(out.numpy(), want_o)
    np.testing.assert_array_equal(lse.numpy(), want_lse)


def test_reference_merges_torch_states_as_it_merges_numpy_ones():
    torch = _torch()
    rng = np.random.default_rng(1)
    o = rng.standard_normal((3, 4, 2, 8)).astype(ml_dtypes.bfloat16)
    lse = rng.standard_normal((3, 4, 2)).astype(f32)
    to_t = [_tensor(o), _tensor(lse)]
    be = ba.get_backend("reference")
    pairs = [(be.merge_states(*to_t), be.merge_states(o, lse)),
             (be.merge_state(to_t[0][:, 0], to_t[1][:, 0], to_t[0][:, 1], to_t[1][:, 1]),
              be.merge_state(o[:, 0], lse[:, 0], o[:, 1], lse[:, 1])),
             ((be.add_states(to_t[0][:, 0], to_t[0][:, 1]),), (be.add_states(o[:, 0], o[:, 1]),))]
    for got, want in pairs:
        for g, w in zip(got, want):
            assert isinstance(g, torch.Tensor) and str(g.dtype).removeprefix("torch.") == w.dtype.name
            np.testing.assert_array_equal(g.float().numpy(), w.astype(np.float32))


def test_the_reference_tier_imports_no_torch_for_numpy_inputs():
    code = ("import sys, numpy as np, bsrattn as ba\n"
            "o, s = np.ones((1, 2, 1, 4)), np.zeros((1, 2, 1))\n"
            "ba.merge_states(o, s); ba.merge_state(o[:, 0], s[:, 0], o[:, 1], s[:, 1])\n"
            "attn = ba.BatchAttention(backend='reference'); attn.plan(ba.layouts.dense(1, 2), 1, 1, 4)\n"
            "attn.run(np.ones((1, 1, 4)), np.ones((2, 1, 4)), np.ones((2, 1, 4)))\n"
            "print('torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "BSRATTN_BACKEND"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


# ---- non-finite KV scales, a Cascade row no flat layout expresses, storage order named --------------------

@pytest.mark.parametrize("scale", [float("inf"), float("nan"), -float("inf")], ids=["inf", "nan", "-inf"])
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_non_finite_kv_scales_are_refused_at_every_entry_point(tier, name, scale):
    q, k, v = arrays()
    message = re.escape(f"{name} must be a positive finite float, got {scale!r}")
    with pytest.raises(ValueError, match=message):
        ba.attention(q, k, v, LAYOUT, backend=tier, **{name: scale})
    attn = ba.BatchAttention(tier)
    attn.plan(LAYOUT, 4, 2, 8)
    attn.run(q, k, v)  # a passing call first: the next must be checked again, not skip the checks
    with pytest.raises(ValueError, match=message):
        attn.run(q, k, v, **{name: scale})


def _cascade_inputs(suffix_lens):
    rng = np.random.default_rng(0)
    cascade = ba.layouts.shared_prefix([3, 1], [0], 4, [[1], [2]], suffix_lens, page_size=4, num_pages=3)
    q = rng.standard_normal((4, 1, 4)).astype(f32)
    k, v = rng.standard_normal((2, 3, 4, 1, 4)).astype(f32)
    return cascade, q, k, v


def test_a_causal_cascade_row_that_no_flat_layout_expresses_is_refused_in_every_mode(tier):
    cascade, q, k, v = _cascade_inputs([1, 2])  # row 0: 3 queries, 1 suffix key
    causal = ba.Variant(causal=True)
    message = r"the Cascade's last level row 0 has 3 queries and 1 keys"
    for call in (lambda: ba.attention(q, k, v, cascade, variant=causal, backend=tier),
                 lambda: ba.attention(q, k, v, cascade, variant=causal, backend=tier, deterministic=True,
                                      split_size=64),
                 lambda: ba.BatchAttention(tier).plan(cascade, 1, 1, 4, variant=causal),
                 lambda: cascade.flatten(causal=True)):
        with pytest.raises(ValueError, match=message):
            call()
    plain = ba.attention(q, k, v, cascade, backend=tier)  # without the causal mask every query sees all its keys
    flat = ba.attention(q, k.reshape(-1, 1, 1, 4), v.reshape(-1, 1, 1, 4), cascade.flatten(), backend=tier)
    np.testing.assert_allclose(np.asarray(plain), np.asarray(flat), atol=1e-5)


def test_a_causal_cascade_row_with_one_query_past_its_keys_is_one_attention_in_every_mode(tier):
    cascade, q, k, v = _cascade_inputs([2, 2])  # row 0: 3 queries, 2 suffix keys: its first sees the prefix only
    causal = ba.Variant(causal=True)
    normal = ba.attention(q, k, v, cascade, variant=causal, backend=tier)
    deterministic = ba.attention(q, k, v, cascade, variant=causal, backend=tier, deterministic=True, split_size=64)
    flat = ba.attention(q, k.reshape(-1, 1, 1, 4), v.reshape(-1, 1, 1, 4), cascade.flatten(causal=True),
                        variant=causal, backend=tier)
    for other in (deterministic, flat):
        np.testing.assert_allclose(np.asarray(other), np.asarray(normal), atol=1e-5)


def test_kv_in_the_other_storage_order_names_the_kv_layout_that_fits(tier):
    layout = ba.layouts.paged([1], [[0, 1]], [20], page_size=16, num_pages=2)
    q = np.zeros((1, 8, 16), f32)
    hnd = np.zeros((2, 2, 16, 16), f32)  # [num_pages, num_kv_heads, page_size, head_dim]
    with pytest.raises(ValueError, match=re.escape("it fits kv_layout='HND'") + ".*pass kv_layout='HND'"):
        ba.attention(q, hnd, hnd, layout, backend=tier)
    nhd = np.zeros((2, 16, 2, 16), f32)
    with pytest.raises(ValueError, match=re.escape("it fits kv_layout='NHD'")):
        ba.attention(q, nhd, nhd, layout, backend=tier, kv_layout="HND")
    assert ba.attention(q, hnd, hnd, layout, backend=tier, kv_layout="HND").shape == q.shape


@pytest.mark.parametrize("call, message", [
    (lambda: ba.BSRLayout([], [], [], [], 1, 1), r"qo_indptr is empty; it must be \[R\+1\]"),
    (lambda: ba.layouts.paged([1, 1], [[0], [1]], [3], page_size=4, num_pages=2),
     r"qo_lens has 2 entries and kv_lens has 1"),
    (lambda: ba.layouts.ragged([1], [3, 4]), r"qo_lens has 1 entries and kv_lens has 2"),
    (lambda: ba.scheduler.plan([1, 1], [3], num_ctas=2), r"qo_lens has 2 entries and kv_lens has 1"),
    (lambda: ba.layouts.per_head_views(np.zeros((3, 8, 16)), *2 * [np.zeros((5, 2, 16, 16))], num_kv_heads=0),
     r"num_kv_heads must be >= 1, got 0"),
    (lambda: ba.layouts.per_head_views(np.zeros((3, 8, 16)), *2 * [np.zeros((5, 2, 16, 16))], num_kv_heads=2.0),
     r"num_kv_heads must be an int, got 2\.0"),
], ids=["empty qo_indptr", "paged lengths", "ragged lengths", "plan lengths", "no KV heads", "float KV heads"])
def test_errors_name_the_argument_that_is_wrong(call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        call()


def _run_without_a_gpu(code, **env):
    """``code`` in a fresh process that sees no GPU, with ``env`` over this one's environment (the simulator and
    the interpreter off unless ``env`` says)."""
    base = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "TRITON_INTERPRET")}
    base["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**base, **env},
                            timeout=300)
    return result.returncode, result.stdout + result.stderr


NUMBA_UNAVAILABLE = ("import bsrattn as ba\n"
                     "{before}\n"
                     "try:\n"
                     "    {call}\n"
                     "except ba.BackendError as err:\n"
                     "    print('refused:', err)\n")


@pytest.mark.parametrize("call", ["ba.get_backend('numba')",
                                  "ba.integrations.transformers.register(backend='numba')"], ids=["load", "register"])
def test_the_numba_tier_without_a_gpu_or_the_simulator_names_the_variable(call):
    pytest.importorskip("numba")
    if call.startswith("ba.integrations"):
        pytest.importorskip("transformers")
        call = "import bsrattn.integrations.transformers; " + call
    code, out = _run_without_a_gpu(NUMBA_UNAVAILABLE.format(before="", call=call))
    assert code == 0, out
    assert "refused:" in out and "set NUMBA_ENABLE_CUDASIM=1 before numba is imported" in out, out
    late = "import numba.cuda, os; os.environ['NUMBA_ENABLE_CUDASIM'] = '1'"
    code, out = _run_without_a_gpu(NUMBA_UNAVAILABLE.format(before=late, call=call))
    assert code == 0, out
    assert "NUMBA_ENABLE_CUDASIM was set after numba was imported" in out and "restart" in out, out


def test_the_interpreter_switched_on_after_the_torch_tier_loaded_says_to_restart():
    _torch()
    code = ("import os, numpy as np, torch, bsrattn as ba\n"
            "import bsrattn.torch_cuda\n"
            "os.environ['TRITON_INTERPRET'] = '1'\n"
            "q = torch.zeros(1, 2, 8); kv = torch.zeros(4, 2, 8)\n"
            "try:\n"
            "    ba.attention(q, kv, kv, ba.layouts.ragged([1], [4]), backend='torch')\n"
            "except ValueError as err:\n"
            "    print('refused:', err)\n")
    status, out = _run_without_a_gpu(code)
    assert status == 0, out
    assert "refused:" in out and "TRITON_INTERPRET changed after the tier was imported" in out, out
    assert "restart the process" in out, out
