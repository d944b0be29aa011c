"""A warp-specialised Hopper prefill in Gluon, standalone: the first rung of the torch tier's Hopper prefill path.

W3 times it beside the torch tier's Triton path (``bsrattn-gluon-ws`` rows, ragged layouts only) before it moves behind
``BatchAttention``. It computes what :func:`bsrattn.reference.executor.execute` computes for a ragged layout whose
every row has as many queries as keys (``qo_len == kv_len``, the prefill of fresh requests), with or without the
causal mask, and writes ``out`` and the natural-log ``lse``.

One CTA runs one 128-query tile of one query head, in three partitions (``gl.warp_specialize``):

- the producer (the default partition: 4 warps, 24 registers a thread) copies the tile's queries, then each K
  and V tile, through the tensor-memory engine (TMA) into a ring of ``STAGES`` shared-memory slots, each slot's
  arrival signalled on an mbarrier;
- two consumers (4 warps each, one warpgroup, 240 registers a thread) take 64 of the tile's queries each:
  ``S = Q K^T`` and ``O += P V`` on ``warpgroup_mma`` (asynchronous ``wgmma``), the online softmax in registers,
  and a slot handed back to the producer once both consumers are done with it.

The two consumers share every K and V tile and run independently, so one's softmax overlaps the other's products
(the warp schedulers interleave them). ``PIPE=1`` adds FA3's overlap inside a warpgroup: tile ``j``'s ``Q K^T`` is
issued beside tile ``j - 1``'s ``P V``, and tile ``j``'s softmax runs while the latter is in flight
(``warpgroup_mma_wait(num_outstanding=1)``). Causal tiles wholly below a consumer's first query run without a mask.

What it lacks, against the shipped path: paged or otherwise gathered keys (TMA reads each row's keys as one box),
split rows and their merges, the prior fold, deterministic mode, the variants but the causal mask, fp32 and fp8,
head dimensions other than 64 and 128, a persistent schedule (one CTA a tile: each tile pays its own start and
its own epilogue, which no other tile's work overlaps) and CUDA-graph capacity across re-plans (the tile table is
built per call). ``benchmarks/NOTES.md`` (prefill) has its figures.

Triton 3.6 (the H200's) and 3.9 (the CPU hosts') both compile it for sm_90; :func:`unavailable` says why it cannot
run here.
"""

from __future__ import annotations

import math

import numpy as np

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
        warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError as err:  # a Triton without Gluon's Hopper API
    _MISSING = f"this Triton has no Gluon Hopper API ({type(err).__name__}: {err})"
else:
    _MISSING = None

LOG2E = 1.4426950408889634
BLOCK_M, BLOCK_N, STAGES = 128, 128, 2
"""A CTA's queries (64 a consumer), the keys of a K/V tile, the ring's slots: 160 KiB of shared memory at d128."""
HEAD_DIMS = (64, 128)


def unavailable(device=None) -> str | None:
    """Why the kernel cannot run on ``device`` (default: the current CUDA device), or None when it can."""
    if _MISSING:
        return _MISSING
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    cc = torch.cuda.get_device_capability(device)
    if cc != (9, 0):
        return f"needs an sm_90 GPU (Hopper: wgmma, TMA, setmaxnreg), this one is sm_{cc[0]}{cc[1]}"
    return None


if _MISSING is None:
    # Triton 3.6 names the tensor-memory copy into shared memory async_copy_global_to_shared; later versions async_load.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _LN2 = gl.constexpr(1 / LOG2E)

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, tiles,
                  GROUP: gl.constexpr, CAUSAL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                  NUM_STAGES: gl.constexpr):
        t = gl.program_id(0)
        head = gl.program_id(1)
        row0 = gl.load(tiles + 3 * t)  # the request's first row of q, k and v
        m0 = gl.load(tiles + 3 * t + 1)  # the tile's first query, counted in the request
        seqlen = gl.load(tiles + 3 * t + 2)
        mbarrier.expect(q_bar, BM * D * q_desc.dtype.primitive_bitwidth // 8)
        _tma_load(q_desc, [row0 + m0, head * D], q_bar, q_smem)
        hi = seqlen
        if CAUSAL:
            hi = gl.minimum(seqlen, m0 + BM)
        for j in range(gl.cdiv(hi, BN)):
            s = j % NUM_STAGES
            # A slot is free once both consumers arrived on it; a fresh barrier passes the first round's wait.
            mbarrier.wait(kv_empty.index(s), ((j // NUM_STAGES) & 1) ^ 1)
            mbarrier.expect(kv_ready.index(s), 2 * BN * D * k_desc.dtype.primitive_bitwidth // 8)
            _tma_load(k_desc, [row0 + j * BN, head // GROUP * D], kv_ready.index(s), k_smem.index(s))
            _tma_load(v_desc, [row0 + j * BN, head // GROUP * D], kv_ready.index(s), v_smem.index(s))

    @gluon.jit
    def _mask(sc, j, q_rows, seqlen, BN: gl.constexpr, CAUSAL: gl.constexpr, cols: gl.constexpr):
        """Scores of keys past the request (a tile's tail reads the next request's rows) or after a query: -inf."""
        keys = j * BN + gl.arange(0, BN, layout=cols)
        visible = keys[None, :] < seqlen
        if CAUSAL:
            visible = visible & (keys[None, :] <= q_rows[:, None])
        return gl.where(visible, sc, float("-inf"))

    @gluon.jit
    def _softmax_step(sc, m_i, l_i, qk_scale):
        """The online softmax's step over one tile's scores: ``(p, alpha, m_new, l_new)``, ``p`` the tile's weights
        at the new running maximum and ``alpha`` the factor that brings the old state to it."""
        m_new = gl.maximum(m_i, gl.max(sc, axis=1) * qk_scale)
        p = gl.exp2(sc * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)

    @gluon.jit
    def _consumer(out_ptr, lse_ptr, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, tiles, num_qo_heads, qk_scale,
                  CAUSAL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                  NUM_STAGES: gl.constexpr, PIPE: gl.constexpr, CONSUMER: gl.constexpr):
        HALF: gl.constexpr = BM // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = q_smem.dtype

        t = gl.program_id(0)
        head = gl.program_id(1)
        row0 = gl.load(tiles + 3 * t)
        m0 = gl.load(tiles + 3 * t + 1)
        seqlen = gl.load(tiles + 3 * t + 2)
        first = m0 + CONSUMER * HALF  # this warpgroup's first query
        hi = seqlen
        if CAUSAL:
            hi = gl.minimum(seqlen, m0 + BM)
        n_tiles = gl.cdiv(hi, BN)
        # K/V tiles of keys that every query of this half sees: inside the request, and causally before its first.
        n_free = seqlen // BN
        if CAUSAL:
            n_free = gl.minimum(n_free, (first + 1) // BN)
        q_rows = first + gl.arange(0, HALF, layout=s_rows)

        mbarrier.wait(q_bar, 0)
        q = q_smem.slice(CONSUMER * HALF, HALF, dim=0)  # [HALF, D]
        acc = gl.zeros([HALF, D], gl.float32, layout=o_layout)
        if PIPE == 0:
            m_i = gl.full([HALF], float("-inf"), gl.float32, layout=s_rows)
            l_i = gl.zeros([HALF], gl.float32, layout=s_rows)
            for j in range(n_tiles):
                s = j % NUM_STAGES
                mbarrier.wait(kv_ready.index(s), (j // NUM_STAGES) & 1)
                sc = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), gl.zeros([HALF, BN], gl.float32, s_layout),
                                   use_acc=False, is_async=True)
                sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
                if j >= n_free:
                    sc = _mask(sc, j, q_rows, seqlen, BN, CAUSAL, s_cols)
                p, alpha, m_new, l_i = _softmax_step(sc, m_i, l_i, qk_scale)
                acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
                acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(s), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(kv_empty.index(s), count=1)
                m_i = m_new
        else:
            # Tile 0's scores alone; then each step issues tile j's Q K^T beside tile j-1's P V and runs tile j's
            # softmax while P V is in flight. Every query sees key 0, so no row's maximum stays -inf.
            mbarrier.wait(kv_ready.index(0), 0)
            sc = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), gl.zeros([HALF, BN], gl.float32, s_layout),
                               use_acc=False, is_async=True)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
            if n_free == 0:
                sc = _mask(sc, 0, q_rows, seqlen, BN, CAUSAL, s_cols)
            m_i = gl.max(sc, axis=1) * qk_scale
            p = gl.exp2(sc * qk_scale - m_i[:, None])
            l_i = gl.sum(p, axis=1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            for j in range(1, n_tiles):
                s = j % NUM_STAGES
                prev = (j - 1) % NUM_STAGES
                mbarrier.wait(kv_ready.index(s), (j // NUM_STAGES) & 1)
                sc = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), gl.zeros([HALF, BN], gl.float32, s_layout),
                                   use_acc=False, is_async=True)
                acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
                sc = warpgroup_mma_wait(num_outstanding=1, deps=(sc,))
                if j >= n_free:
                    sc = _mask(sc, j, q_rows, seqlen, BN, CAUSAL, s_cols)
                p, alpha, m_new, l_i = _softmax_step(sc, m_i, l_i, qk_scale)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(kv_empty.index(prev), count=1)
                acc = acc * gl.convert_layout(alpha, o_rows)[:, None]  # after P V(j-1), which was at the old max
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                m_i = m_new
            last = (n_tiles - 1) % NUM_STAGES
            acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(kv_empty.index(last), count=1)

        acc = acc / gl.convert_layout(l_i, o_rows)[:, None]
        rows = first + gl.arange(0, HALF, layout=o_rows)
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        ptrs = out_ptr + ((row0 + rows).to(gl.int64) * num_qo_heads + head)[:, None] * D + cols[None, :]
        gl.store(ptrs, acc.to(dtype), mask=(rows < seqlen)[:, None])
        gl.store(lse_ptr + (row0 + q_rows).to(gl.int64) * num_qo_heads + head, (m_i + gl.log2(l_i)) * _LN2,
                 mask=q_rows < seqlen)

    @gluon.jit
    def prefill_kernel(q_desc, k_desc, v_desc,  # q [nnz, num_qo_heads * D], k and v [nnz, num_kv_heads * D]
                       out_ptr,  # [nnz, num_qo_heads, D]
                       lse_ptr,  # [nnz, num_qo_heads] float32
                       tiles,  # [T, 3] int32: the request's first row, the tile's first query, the request's length
                       num_qo_heads, qk_scale,  # qk_scale: sm_scale * log2(e)
                       GROUP: gl.constexpr, CAUSAL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                       D: gl.constexpr, NUM_STAGES: gl.constexpr, PIPE: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [BM, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BN, D], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(kv_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)  # both consumers
        fence_async_shared()
        gl.warp_specialize([
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, tiles, GROUP,
                         CAUSAL, BM, BN, D, NUM_STAGES)),
            (_consumer, (out_ptr, lse_ptr, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, tiles, num_qo_heads,
                         qk_scale, CAUSAL, BM, BN, D, NUM_STAGES, PIPE, 0)),
            (_consumer, (out_ptr, lse_ptr, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, tiles, num_qo_heads,
                         qk_scale, CAUSAL, BM, BN, D, NUM_STAGES, PIPE, 1)),
        ], [4, 4], [240, 240])


def tile_table(lens, causal: bool, block_m: int = BLOCK_M) -> np.ndarray:
    """``[T, 3]`` int32: a request's first row, the tile's first query and the request's length, for every
    ``block_m``-query tile of every request, the tiles with the most keys first (their CTAs start first, so the
    short tiles fill in behind them)."""
    lens = np.asarray(lens, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    per = -(-lens // block_m)
    req = np.repeat(np.arange(lens.size), per)
    m0 = (np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per)) * block_m
    work = np.minimum(lens[req], m0 + block_m) if causal else lens[req]
    order = np.argsort(-work, kind="stable")
    return np.stack([starts[req], m0, lens[req]], axis=1)[order].astype(np.int32)


def prefill(q, k, v, lens, *, causal: bool, sm_scale: float | None = None, pipe: int = 0, block_n: int = BLOCK_N,
            stages: int = STAGES, tiles=None, out=None, lse=None):
    """``(out, lse)`` of each request's queries over its own keys.

    Parameters
    ----------
    q : ``[nnz, num_qo_heads, head_dim]`` fp16 or bf16, contiguous
    k, v : ``[nnz, num_kv_heads, head_dim]``, ``q``'s dtype, contiguous
    lens : ``[B]`` ints
        Each request's length (queries = keys), its rows back to back in ``q``, ``k`` and ``v``.
    causal : bool
    sm_scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    pipe, block_n, stages :
        The consumers' pipelining (0 or 1, the module's text), the K/V tile's keys and the ring's slots.
    tiles : ``[T, 3]`` int32 tensor on the device, optional
        :func:`tile_table` of ``lens``, made ahead to keep it out of a timed call.
    out : ``[nnz, num_qo_heads, head_dim]``, ``q``'s dtype, contiguous, optional
    lse : ``[nnz, num_qo_heads]`` float32, contiguous, optional
        Where to write; new tensors by default.
    """
    import torch

    if _MISSING:
        raise RuntimeError(_MISSING)
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"q must be [nnz, num_qo_heads, head_dim] and k, v [nnz, num_kv_heads, head_dim]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    nnz, num_qo_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape[0] != nnz or k.shape[2] != head_dim or num_qo_heads % num_kv_heads:
        raise ValueError(f"k {tuple(k.shape)} does not fit q {tuple(q.shape)}: as many rows, the same head_dim, "
                         f"and num_qo_heads a multiple of num_kv_heads")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} is not one of {HEAD_DIMS}")
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must all be float16 or all bfloat16; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        raise ValueError("q, k and v must be contiguous: the tensor-memory engine reads each head's rows as a box")
    if int(np.sum(lens)) != nnz:
        raise ValueError(f"lens sum to {int(np.sum(lens))}, but q has {nnz} rows")
    if pipe not in (0, 1):
        raise ValueError(f"pipe={pipe!r} must be 0 or 1")
    if tiles is None:
        tiles = torch.as_tensor(tile_table(lens, causal), device=q.device)
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(nnz, num_qo_heads, dtype=torch.float32, device=q.device) if lse is None else lse
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {q.dtype} tensor of q's shape {tuple(q.shape)}; got "
                         f"{out.dtype} {tuple(out.shape)}")
    if lse.shape != (nnz, num_qo_heads) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"lse must be a contiguous float32 tensor of shape {(nnz, num_qo_heads)}; got {lse.dtype} "
                         f"{tuple(lse.shape)}")
    scale = 1 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    if tiles.shape[0]:  # none for a batch of empty requests, whose arrays a descriptor cannot describe
        gdtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
        q_desc = TensorDescriptor.from_tensor(q.view(nnz, num_qo_heads * head_dim), [BLOCK_M, head_dim],
                                              gl.NVMMASharedLayout.get_default_for([BLOCK_M, head_dim], gdtype))
        kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], gdtype)
        k_desc, v_desc = (TensorDescriptor.from_tensor(x.view(nnz, num_kv_heads * head_dim), [block_n, head_dim],
                                                       kv_layout) for x in (k, v))
        prefill_kernel[(tiles.shape[0], num_qo_heads)](
            q_desc, k_desc, v_desc, out, lse, tiles, num_qo_heads, scale * LOG2E, GROUP=num_qo_heads // num_kv_heads,
            CAUSAL=causal, BM=BLOCK_M, BN=block_n, D=head_dim, NUM_STAGES=stages, PIPE=pipe, num_warps=4)
    return out, lse
