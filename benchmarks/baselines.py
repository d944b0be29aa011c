"""The baselines measured beside bsrattn: FlashInfer (optional), FlexAttention, and the JIT prebuild.

FlashInfer is never a dependency of bsrattn. :func:`flashinfer` imports it on demand and raises
:class:`~benchmarks.harness.Unavailable` with the reason when it cannot, so a script records
``unavailable: <reason>`` and goes on. The wrappers used are its public Python API (0.6.x):
``BatchDecodeWithPagedKVCacheWrapper`` (CUDA-core and tensor-core decode), ``BatchPrefillWithRaggedKVCacheWrapper``
and ``BatchPrefillWithPagedKVCacheWrapper`` (``backend="fa2"`` / ``"fa3"``), ``MultiLevelCascadeAttentionWrapper``
(the cascade as shipped), ``merge_state_in_place`` (to build the same two-level cascade on fa2 kernels),
``BatchAttentionWithAttentionSinkWrapper`` (attention sinks) and ``BatchMLAPagedAttentionWrapper`` (MLA,
``backend="fa2"`` / ``"fa3"``). The decode and prefill adapters pass an attention variant's keywords on to
``plan`` (``logits_soft_cap``, ``window_left``, ``pos_encoding_mode``, ``rope_theta``, ``rope_scale``).

FlashInfer compiles each kernel family the first time it is planned (JIT, ~13 s for decode, longer for
prefill). ``python3 -m benchmarks.baselines prebuild [--quick]`` plans every family the suite uses on a tiny
problem, in the order the suite needs them; ``run_all.py`` starts it in a separate process so the builds
overlap the first workloads (FlashInfer's file locks make the suite wait for a module still being built).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from functools import partial

from benchmarks.harness import Unavailable  # sets FLASHINFER_CUDA_ARCH_LIST first

WORKSPACE_BYTES = 256 << 20
_workspace = {}


def flashinfer():
    """The ``flashinfer`` module, or :class:`Unavailable` saying why it cannot be used here."""
    try:
        import flashinfer as fi
    except Exception as exc:  # any import failure means "not available", never a crash
        raise Unavailable(f"FlashInfer is not importable ({type(exc).__name__}: {exc})") from exc
    return fi


def workspace(device="cuda"):
    """One zeroed float workspace per device, shared by every wrapper (their runs never overlap)."""
    import torch

    if device not in _workspace:
        _workspace[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspace[device]


def decode_wrapper(indptr, indices, last_page_len, *, num_qo_heads, num_kv_heads, head_dim, page_size, q_dtype,
                   kv_dtype, tensor_cores, disable_split_kv=False, **variant):
    """A planned ``BatchDecodeWithPagedKVCacheWrapper`` over an NHD paged cache.

    Parameters
    ----------
    indptr : ``[B+1]`` int32; indices : ``[nnz_pages]`` int32; last_page_len : ``[B]`` int32
        The page table in BSR form (a bsrattn layout's ``kv_indptr``, ``kv_indices``, ``kv_last_len``).
    tensor_cores : bool
        ``use_tensor_cores``: FlashInfer's prefill kernels run as decode (its "tensor-core decode").
    disable_split_kv : bool
        One CTA per request (tensor-core decode only), for the scheduler on/off comparison.
    **variant
        ``plan``'s keywords of an attention variant (``logits_soft_cap``, ``window_left``, ``pos_encoding_mode``,
        ``rope_theta``, ``rope_scale``).
    """
    fi = flashinfer()
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_tensor_cores=tensor_cores)
    extra = {"disable_split_kv": True} if disable_split_kv else {}
    wrapper.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                 q_data_type=q_dtype, kv_data_type=kv_dtype, **extra, **variant)
    return wrapper


def ragged_prefill_wrapper(qo_indptr, kv_indptr, *, num_qo_heads, num_kv_heads, head_dim, dtype, causal, backend,
                           **variant):
    """A planned ``BatchPrefillWithRaggedKVCacheWrapper`` (``backend`` ``"fa2"`` or ``"fa3"``); ``variant`` as
    :func:`decode_wrapper` takes it."""
    fi = flashinfer()
    wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace(), "NHD", backend=backend)
    wrapper.plan(qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim, causal=causal, q_data_type=dtype,
                 kv_data_type=dtype, **variant)
    return wrapper


def paged_prefill_wrapper(qo_indptr, indptr, indices, last_page_len, *, num_qo_heads, num_kv_heads, head_dim,
                          page_size, dtype, causal, backend, **variant):
    """A planned ``BatchPrefillWithPagedKVCacheWrapper`` over an NHD paged cache; ``variant`` as
    :func:`decode_wrapper` takes it."""
    fi = flashinfer()
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD", backend=backend)
    wrapper.plan(qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                 causal=causal, q_data_type=dtype, kv_data_type=dtype, **variant)
    return wrapper


def sink_prefill_wrapper(qo_indptr, indptr, indices, last_page_len, *, num_qo_heads, num_kv_heads, head_dim,
                         page_size, dtype, causal, backend):
    """A planned ``BatchAttentionWithAttentionSinkWrapper``: :func:`paged_prefill_wrapper` with FlashInfer's
    ``AttentionSink`` variant (JIT-built per dtype and backend). Call ``.run(q, (k, v), sinks, sm_scale)``:
    ``sinks`` ``[num_qo_heads]`` float32 logits, ``sm_scale`` a float (the variant's own arguments, positional).
    """
    fi = flashinfer()
    wrapper = fi.BatchAttentionWithAttentionSinkWrapper(workspace(), "NHD", backend=backend, q_data_type=dtype,
                                                        kv_data_type=dtype, head_dim_qk=head_dim,
                                                        head_dim_vo=head_dim)
    wrapper.plan(qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                 causal=causal, q_data_type=dtype, kv_data_type=dtype)
    return wrapper


def mla_wrapper(qo_indptr, kv_indptr, kv_indices, kv_lens, *, num_heads, head_dim_ckv, head_dim_kpe, page_size,
                sm_scale, dtype, backend):
    """A planned ``BatchMLAPagedAttentionWrapper`` (``backend`` ``"fa2"`` or ``"fa3"``) over a paged latent cache, no
    causal mask (decode). Call ``.run(q_nope, q_pe, ckv, kpe, out=)``: ``ckv [num_pages, page_size, head_dim_ckv]``
    and ``kpe [num_pages, page_size, head_dim_kpe]``, read by their page and slot strides (views of one cache
    array do).

    Parameters
    ----------
    qo_indptr, kv_indptr : ``[B+1]`` int32
        Where each request's query rows and pages start (a bsrattn layout's ``qo_indptr``, ``kv_indptr``).
    kv_indices : ``[nnz_pages]`` int32
    kv_lens : ``[B]`` int32
        Each request's KV length in tokens (0.6.6's ``plan`` docstring calls this ``kv_len_arr`` "the query length").
    sm_scale : float
        ``plan`` takes it without default.
    """
    fi = flashinfer()
    wrapper = fi.BatchMLAPagedAttentionWrapper(workspace(), backend=backend)
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, num_heads, head_dim_ckv, head_dim_kpe, page_size, False,
                 sm_scale, dtype, dtype)
    return wrapper


def cascade_fa2(levels, *, num_qo_heads, num_kv_heads, head_dim, page_size, dtype):
    """FlashInfer's two-level cascade on fa2 kernels: what ``MultiLevelCascadeAttentionWrapper`` does, with
    ``backend="fa2"`` prefill wrappers (the shipped wrapper picks fa3 on Hopper, whose prefix level is never
    split across CTAs).

    Parameters
    ----------
    levels : list of ``(qo_indptr, indptr, indices, last_page_len)`` int32 tensors, prefix level first.

    Returns
    -------
    run : callable ``run(q, (k, v)) -> out`` (``q [B, Hq, D]``)
    """
    fi = flashinfer()
    wrappers = [paged_prefill_wrapper(*level, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                      head_dim=head_dim, page_size=page_size, dtype=dtype,
                                      causal=i == len(levels) - 1, backend="fa2")
                for i, level in enumerate(levels)]

    def run(q, kv):
        out, lse = wrappers[-1].run(q, kv, return_lse=True)
        for wrapper in wrappers[:-1]:
            o_i, lse_i = wrapper.run(q, kv, return_lse=True)
            fi.merge_state_in_place(out, lse, o_i, lse_i)
        return out

    return run


def cascade_shipped(levels, *, num_qo_heads, num_kv_heads, head_dim, page_size, dtype):
    """``MultiLevelCascadeAttentionWrapper`` as shipped (its backend choice), planned; call ``.run(q, (k, v))``."""
    fi = flashinfer()
    wrapper = fi.MultiLevelCascadeAttentionWrapper(len(levels), workspace(), "NHD")
    wrapper.plan(*[list(x) for x in zip(*levels)], num_qo_heads, num_kv_heads, head_dim, page_size, causal=True,
                 q_data_type=dtype, kv_data_type=dtype)
    return wrapper


_flex = {}


def flex_attention(device: str):
    """``flex_attention`` compiled on CUDA (what users run), plain on the CPU (dry runs), and ``create_block_mask``."""
    if device not in _flex:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention as flex

        if device == "cuda":
            # Each (shape, block size) is a new specialisation; keep all of them compiled.
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, 64)
            flex = torch.compile(flex)
        else:
            # Dry runs check the plumbing on tiny shapes; the unfused path is what they want.
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        _flex[device] = (flex, create_block_mask)
    return _flex[device]


# ---- JIT prebuild -----------------------------------------------------------------------------------------
VARIANT_MODULES = {"soft cap": {"logits_soft_cap": 30.0}, "sliding window": {"window_left": 7},
                   "ALiBi": {"pos_encoding_mode": "ALIBI"}, "RoPE": {"pos_encoding_mode": "ROPE_LLAMA"}}
"""W10's variants, one plan each: FlashInfer builds a module per combination of them that is on (the values do
not matter), on top of the dtypes and the head dimension."""


def _tiny_decode(q_dtype, kv_dtype, tensor_cores, **variant):
    import torch

    i32 = dict(dtype=torch.int32, device="cuda")
    decode_wrapper(torch.tensor([0, 2], **i32), torch.tensor([0, 1], **i32), torch.tensor([16], **i32),
                   num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, q_dtype=q_dtype, kv_dtype=kv_dtype,
                   tensor_cores=tensor_cores, **variant)


def _tiny_ragged(dtype, backend, **variant):
    import torch

    i32 = dict(dtype=torch.int32, device="cuda")
    ragged_prefill_wrapper(torch.tensor([0, 16], **i32), torch.tensor([0, 16], **i32), num_qo_heads=32,
                           num_kv_heads=8, head_dim=128, dtype=dtype, causal=True, backend=backend, **variant)


def _tiny_paged(dtype, backend, causal):
    import torch

    i32 = dict(dtype=torch.int32, device="cuda")
    paged_prefill_wrapper(torch.tensor([0, 1], **i32), torch.tensor([0, 1], **i32), torch.tensor([0], **i32),
                          torch.tensor([16], **i32), num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                          dtype=dtype, causal=causal, backend=backend)


def _tiny_sink(dtype, backend):
    import torch

    i32 = dict(dtype=torch.int32, device="cuda")
    sink_prefill_wrapper(torch.tensor([0, 1], **i32), torch.tensor([0, 1], **i32), torch.tensor([0], **i32),
                         torch.tensor([16], **i32), num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                         dtype=dtype, causal=False, backend=backend)


def _tiny_cascade_shipped(dtype):
    import torch

    i32 = dict(dtype=torch.int32, device="cuda")
    levels = [(torch.tensor([0, 2], **i32), torch.tensor([0, 1], **i32), torch.tensor([0], **i32),
               torch.tensor([16], **i32)),
              (torch.tensor([0, 1, 2], **i32), torch.tensor([0, 1, 2], **i32), torch.tensor([1, 2], **i32),
               torch.tensor([16, 16], **i32))]
    cascade_shipped(levels, num_qo_heads=32, num_kv_heads=32, head_dim=128, page_size=16, dtype=dtype)


def _tiny_merge(dtype):
    import torch

    o = torch.randn(2, 32, 128, dtype=dtype, device="cuda")
    s = torch.randn(2, 32, dtype=torch.float32, device="cuda")
    flashinfer().merge_state_in_place(o, s, o.clone(), s.clone())


def _tiny_mla(dtype, backend):
    import torch

    i32 = dict(dtype=torch.int32, device="cuda")
    mla_wrapper(torch.tensor([0, 1], **i32), torch.tensor([0, 1], **i32), torch.tensor([0], **i32),
                torch.tensor([64], **i32), num_heads=128, head_dim_ckv=512, head_dim_kpe=64, page_size=64,
                sm_scale=576 ** -0.5, dtype=dtype, backend=backend)


def prebuild_steps(quick: bool, workloads=("w1", "w2", "w3", "w4", "w5", "w6", "w8", "w10", "w11")):
    """``(name, fn)`` per FlashInfer JIT module the selected workloads use, in the order they need them."""
    import torch

    f16, bf16, e4m3 = torch.float16, torch.bfloat16, torch.float8_e4m3fn
    # (name, workloads that use it, those of them whose --quick run needs it, build)
    steps = [("decode fp16 (CUDA-core)", "w1 w2 w4 w5 w6 w8 w10", "w1 w2 w4 w5 w6 w8 w10",
              lambda: _tiny_decode(f16, f16, False)),
             ("decode fp16 (tensor-core: fa2 prefill fp16)", "w2 w4 w5 w6 w10", "w2 w4 w5 w6",
              lambda: _tiny_decode(f16, f16, True)),
             ("decode fp16 q / fp8-e4m3 KV (CUDA-core)", "w2", "w2", lambda: _tiny_decode(f16, e4m3, False)),
             ("merge_state_in_place fp16", "w5", "w5", lambda: _tiny_merge(f16)),
             ("ragged prefill bf16 fa2", "w3 w8 w10", "w3 w8 w10", lambda: _tiny_ragged(bf16, "fa2")),
             ("ragged prefill bf16 fa3", "w3 w10", "w3", lambda: _tiny_ragged(bf16, "fa3")),
             ("paged prefill bf16 fa2, causal and not (W3's shared prefix)", "w3", "w3",
              lambda: (_tiny_paged(bf16, "fa2", True), _tiny_paged(bf16, "fa2", False))),
             ("paged prefill bf16 fa3", "w3", "w3", lambda: _tiny_paged(bf16, "fa3", True)),
             ("merge_state_in_place bf16", "w3", "w3", lambda: _tiny_merge(bf16)),
             ("decode bf16 (CUDA-core)", "w2", "", lambda: _tiny_decode(bf16, bf16, False)),
             ("decode bf16 (tensor-core: fa2 prefill bf16)", "w2", "", lambda: _tiny_decode(bf16, bf16, True)),
             ("cascade as shipped fp16 (fa3)", "w5", "", lambda: _tiny_cascade_shipped(f16)),
             ("decode fp16 q / fp8-e4m3 KV (tensor-core)", "w2", "", lambda: _tiny_decode(f16, e4m3, True))]
    # W10, in the order it runs: decode then prefill, each variant after the plain module.
    steps += [(f"decode fp16 (CUDA-core), {name}", "w10", "w10", partial(_tiny_decode, f16, f16, False, **plan))
              for name, plan in VARIANT_MODULES.items()]
    steps += [(f"decode fp16 (tensor-core), {name}", "w10", "", partial(_tiny_decode, f16, f16, True, **plan))
              for name, plan in VARIANT_MODULES.items()]
    steps += [("attention sinks fp16 fa2", "w10", "", partial(_tiny_sink, f16, "fa2"))]
    steps += [(f"ragged prefill bf16 fa2, {name}", "w10", "w10", partial(_tiny_ragged, bf16, "fa2", **plan))
              for name, plan in VARIANT_MODULES.items()]
    steps += [(f"ragged prefill bf16 fa3, {name}", "w10", "", partial(_tiny_ragged, bf16, "fa3", **plan))
              for name, plan in VARIANT_MODULES.items() if name in ("soft cap", "sliding window")]
    steps += [(f"attention sinks bf16 {backend}", "w10", "", partial(_tiny_sink, bf16, backend))
              for backend in ("fa2", "fa3")]
    # W11: a module per dtype and backend (the head dimensions, 512 and 64, are DeepSeek's).
    steps += [(f"MLA {name} {backend}", "w11", "w11" if dtype is bf16 else "", partial(_tiny_mla, dtype, backend))
              for name, dtype in (("bf16", bf16), ("fp16", f16)) for backend in ("fa2", "fa3")]
    return [(name, fn) for name, users, quick_users, fn in steps
            if set((quick_users if quick else users).split()) & set(workloads)]


def prebuild(quick: bool, workloads) -> int:
    """Build every module; report each one's time or failure; never raise (failures show up again later)."""
    try:
        flashinfer()
    except Unavailable as exc:
        print(f"prebuild: {exc}", flush=True)
        return 0
    for name, step in prebuild_steps(quick, workloads):
        t0 = time.time()
        try:
            step()
        except Exception as exc:  # the workload that needs this module records the error itself
            print(f"prebuild: {name}: failed after {time.time() - t0:.0f} s ({type(exc).__name__}: {exc})",
                  flush=True)
        else:
            print(f"prebuild: {name}: ready in {time.time() - t0:.0f} s", flush=True)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description="Build FlashInfer's JIT modules that the benchmark suite uses.")
    p.add_argument("command", choices=["prebuild"])
    p.add_argument("--quick", action="store_true", help="only the modules the --quick suite uses")
    p.add_argument("--workloads", default="w1,w2,w3,w4,w5,w6,w8,w10,w11", help="comma-separated workloads to build for")
    args = p.parse_args(argv)
    return prebuild(args.quick, [w.strip() for w in args.workloads.split(",")])


if __name__ == "__main__":
    sys.exit(main())
