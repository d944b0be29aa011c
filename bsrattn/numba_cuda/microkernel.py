"""The dense microkernel over gathered tiles: FlashAttention's online softmax, in the compute precision.

Matches :func:`bsrattn.reference.microkernel.attend` (and ``attend_range``): the same scores, variant and
masks, the same ``(o, lse)`` with masked rows at ``o = 0, lse = -inf``. What differs is the order of work:
the reference sees all keys at once; here keys arrive one shared-memory tile at a time, so each query keeps
a running state and corrects it as larger scores appear::

    m_new = max(m, max_j s_j)                  running max
    alpha = exp(m - m_new)                     how much the old state shrinks
    p_j   = exp(s_j - m_new)
    l     = alpha * l + sum_j p_j              running sum
    acc   = alpha * acc + sum_j p_j v_j        rescaled accumulator
    (end) o = acc / l,  lse = m + log(l)

A block holds ``nq`` queries at a time: ``tile_rows`` query rows times the ``G`` query heads of its head group,
its KV head's heads or an equal share of them (query ``i`` is row ``i // G``, head ``head_group * G + i % G``),
so GQA's heads share every K/V tile the block loads. Work is spread over threads by flat index: (query, key)
pairs for scores and probabilities, (query, d) pairs for the accumulator (``d`` over V's width, ``dim_vo``:
narrower than ``head_dim``, the width of ``q . k``, for MLA), one thread per query for the running sum.
Arithmetic is float32 (float64 for float64 inputs); fp16/bf16/fp8 elements are decoded as they are read.

FlashSigmoid (``Variant.sigmoid_bias``) skips the softmax: ``p_j = sigmoid(s_j + bias)`` and ``acc`` only adds.

The innermost loops (over ``head_dim`` and over a tile's keys) are counted ``while`` loops: Numba lowers
``range()`` to an iterator whose trip counter LLVM does not fold away, about 20 instructions per step of a
dot product, where the ``while`` loop compiles to load, load, convert, FMA.
"""

from __future__ import annotations

import math

from bsrattn import indexing
from bsrattn.numba_cuda.formats import decoder, encoder
from bsrattn.numba_cuda.launch import device, ops

query_position = device(indexing.query_position)
key_visible = device(indexing.key_visible)
mask_offset = device(indexing.mask_offset)
tile_query = device(indexing.tile_query)
tile_head = device(indexing.tile_head)


def make_microkernel(cfg):
    """The microkernel's device functions for one kernel configuration (see ``config.Config``)."""
    compute, threads, tile_kv = cfg.compute, cfg.num_threads, cfg.tile_kv
    head_dim, dim_vo, group_size = cfg.head_dim, cfg.dim_vo, cfg.group_size
    acc_per_thread = cfg.acc_per_thread
    causal, soft_cap, alibi, sigmoid, rope, custom_mask = (cfg.causal, cfg.soft_cap, cfg.alibi, cfg.sigmoid,
                                                           cfg.rope, cfg.custom_mask)
    half = head_dim // 2
    hidden_keys = cfg.hidden_keys
    decode_q, decode_kv = decoder(cfg.q_format, compute), decoder(cfg.kv_format, compute)
    encode_out = encoder(cfg.q_format)
    neg_inf, zero, one, nan = compute(-math.inf), compute(0.0), compute(1.0), compute(math.nan)

    @device
    def load_queries(t, q_tile, m_run, l_run, bad, acc, q, q_row0, nq, head_group, rope_freq, rope_q):
        """``q_tile [max_nq, D]`` (shared) <- the block's queries, decoded (with fused RoPE, turned at their
        positions ``rope_q``: one thread per dimension pair); reset the running state."""
        if rope:
            for e in range(t, nq * half, threads):
                i, d = e // half, e % half
                row, head = q_row0 + tile_query(i, group_size), tile_head(head_group, group_size, i)
                angle = compute(rope_q[row]) * compute(rope_freq[d])
                lo, hi = decode_q(q[row, head, d]), decode_q(q[row, head, d + half])
                q_tile[i, d] = lo * math.cos(angle) - hi * math.sin(angle)
                q_tile[i, d + half] = hi * math.cos(angle) + lo * math.sin(angle)
        else:
            for e in range(t, nq * head_dim, threads):
                i, d = e // head_dim, e % head_dim
                q_tile[i, d] = decode_q(q[q_row0 + tile_query(i, group_size), tile_head(head_group, group_size, i), d])
        for i in range(t, nq, threads):
            m_run[i] = neg_inf
            l_run[i] = zero
            bad[i] = zero
        for n in range(acc_per_thread):
            acc[n] = zero

    @device
    def turn_keys(t, k_turned, k_el, kv0, kv_end, rope_offset, rope_freq):
        """Fused RoPE: ``k_turned [tile_kv, D]`` (shared, compute precision) <- the gathered K tile ``k_el``
        turned at its slots' positions plus ``rope_offset``, one thread per (key, dimension pair); 0 past the
        range."""
        for e in range(t, tile_kv * half, threads):
            j, d = e // half, e % half
            lo, hi = zero, zero
            if kv0 + j < kv_end:
                angle = compute(rope_offset + kv0 + j) * compute(rope_freq[d])
                x, y = decode_kv(k_el[j, d]), decode_kv(k_el[j, d + half])
                lo, hi = x * math.cos(angle) - y * math.sin(angle), y * math.cos(angle) + x * math.sin(angle)
            k_turned[j, d] = lo
            k_turned[j, d + half] = hi

    @device
    def scores(t, s_tile, seen, q_tile, k_el, k_turned, nq, kv0, kv_end, q_row0, row_q_start, qo_len, kv_len,
               head_group, score_scale, window_left, cap, alibi_slopes, mask_start, mask):
        """``s_tile [max_nq, tile_kv]`` (shared) <- transformed scores, ``-inf`` where masked.

        ``k_el [tile_kv, >= D]`` is the gathered K tile (``k_turned [tile_kv, D]`` the same turned, read instead
        with fused RoPE); ``alibi_slopes [Hq]``; ``mask`` the flat custom mask.
        With keys that masks hide (``Config.hidden_keys``), ``seen [max_nq, tile_kv]`` (shared) <- 1 for the
        visible pairs: a visible key's score may itself be ``-inf``, so the scores cannot tell.
        """
        for e in range(t, nq * tile_kv, threads):
            i, j = e // tile_kv, e % tile_kv
            k_pos = kv0 + j
            local_q = q_row0 + tile_query(i, group_size) - row_q_start
            q_pos = query_position(qo_len, kv_len, local_q)
            visible = k_pos < kv_end and key_visible(q_pos, k_pos, causal, window_left)
            if custom_mask and visible:
                visible = mask[mask_offset(mask_start, kv_len, local_q, k_pos)]
            s = neg_inf
            if visible:
                dot, d = zero, 0
                if rope:
                    while d < head_dim:
                        dot += q_tile[i, d] * k_turned[j, d]
                        d += 1
                else:
                    while d < head_dim:
                        dot += q_tile[i, d] * decode_kv(k_el[j, d])
                        d += 1
                s = dot * score_scale
                if soft_cap:
                    s = cap * math.tanh(s / cap)
                if alibi:
                    s += compute(alibi_slopes[tile_head(head_group, group_size, i)]) * compute(k_pos - q_pos)
            s_tile[i, j] = s
            if hidden_keys:
                seen[i, j] = 1 if visible else 0

    @device
    def probabilities(t, s_tile, p_tile, m_run, m_next, alpha, nq, sigmoid_bias):
        """``p_tile [max_nq, tile_kv]`` (shared) <- the weights, one thread per (query, key): ``exp(s - m_new)``.

        Each thread recomputes its query's ``m_new = max(m, max_j s_j)`` from the row of scores (a broadcast
        read) rather than waiting on a separate max pass and its barrier. The key-0 thread of each query records
        ``m_next [max_nq]`` and ``alpha [max_nq] = exp(m - m_new)``. A query that has seen no visible key yet
        (``m_new = -inf``) gets all weights 0 and ``alpha`` 0. FlashSigmoid: ``sigmoid(s + bias)``, 0 if masked.
        """
        for e in range(t, nq * tile_kv, threads):
            i, j = e // tile_kv, e % tile_kv
            s = s_tile[i, j]
            if sigmoid:
                p_tile[i, j] = one / (one + math.exp(-(s + sigmoid_bias))) if s != neg_inf else zero
            else:
                m_new, jj = m_run[i], 0
                while jj < tile_kv:
                    m_new = max(m_new, s_tile[i, jj])
                    jj += 1
                m_safe = m_new if m_new != neg_inf else zero
                p_tile[i, j] = math.exp(s - m_safe)
                if j == 0:
                    m_next[i] = m_new
                    alpha[i] = math.exp(m_run[i] - m_safe)

    @device
    def accumulate(t, acc, m_run, l_run, m_next, alpha, p_tile, seen, v_el, nq):
        """``acc = alpha * acc + P @ V`` per (query, d), ``d`` over V's ``dim_vo`` (``v_el [tile_kv, >= dim_vo]``)
        and, one thread per query, ``l = alpha * l + sum_j p_j`` and ``m = m_new``. (Sigmoid: ``p_tile`` holds the
        weights and nothing is rescaled.)

        A hidden pair is skipped, not multiplied by a zero weight: ``0 * v`` is NaN for a NaN or infinite ``v``,
        and no value of a hidden key may reach the output. Without masks that hide keys, every pair of the
        tile is visible or past the range, whose rows ``load_rows`` zeroed. Each step is one explicit FMA: left
        to the compiler, a guarded step (masks that hide keys) and an unguarded one fused differently, and a
        row's bits depended on the variant's masks (deterministic mode needs them not to)."""
        if not sigmoid:
            for i in range(t, nq, threads):
                total, j = l_run[i] * alpha[i], 0
                while j < tile_kv:
                    total += p_tile[i, j]
                    j += 1
                l_run[i] = total
                m_run[i] = m_next[i]
        for n in range(acc_per_thread):
            e = t + n * threads
            i, d = e // dim_vo, e % dim_vo
            if i < nq:
                a, j = (acc[n] if sigmoid else acc[n] * alpha[i]), 0
                while j < tile_kv:
                    if not hidden_keys or seen[i, j]:
                        a = ops.fma(p_tile[i, j], decode_kv(v_el[j, d]), a)
                    j += 1
                acc[n] = a

    @device
    def flag_rows(t, acc, bad, nq):
        """``bad [max_nq]`` (shared) <- non-zero for each query with a NaN or infinity in its accumulator: a
        visible key's non-finite ``v`` (or a NaN weight) then makes the whole output row NaN (see
        :mod:`bsrattn.reference.microkernel`). Every thread writes the same value, so the writes may race."""
        for n in range(acc_per_thread):
            e = t + n * threads
            i = e // dim_vo
            if i < nq and not math.isfinite(acc[n]):
                bad[i] = one

    @device
    def finish(t, acc, m_run, l_run, bad, nq, q_row0, head_group, v_scale, out, lse, item_q0, part_o, part_lse,
               part_row0):
        """Write the state: ``o = acc / l``, ``lse = m + log l`` (0 and -inf for a query that saw no key).

        ``l`` is NaN when a visible score was NaN or ``+inf``: the row is then NaN, never empty. A row that
        :func:`flag_rows` marked is NaN. An unsplit item (``part_row0 < 0``) writes ``out [nnz_qo, Hq, Dv]`` and
        ``lse [nnz_qo, Hq]`` directly; a split item writes its partial state, unencoded, into
        ``part_o [P, Hq, Dv]`` and ``part_lse [P, Hq]``, query row ``item_q0 + x`` of the item at workspace row
        ``part_row0 + x``.
        """
        for n in range(acc_per_thread):
            e = t + n * threads
            i, d = e // dim_vo, e % dim_vo
            if i < nq:
                if sigmoid:
                    o = nan if bad[i] != zero else acc[n] * v_scale
                elif l_run[i] == zero:
                    o = zero
                else:
                    o = nan if bad[i] != zero else acc[n] / l_run[i] * v_scale
                row, head = q_row0 + tile_query(i, group_size), tile_head(head_group, group_size, i)
                if part_row0 < 0:
                    out[row, head, d] = encode_out(o)
                else:
                    part_o[part_row0 + row - item_q0, head, d] = o
        if not sigmoid:
            for i in range(t, nq, threads):
                s = m_run[i] + math.log(l_run[i]) if l_run[i] != zero else neg_inf
                row, head = q_row0 + tile_query(i, group_size), tile_head(head_group, group_size, i)
                if part_row0 < 0:
                    lse[row, head] = s
                else:
                    part_lse[part_row0 + row - item_q0, head] = s

    return load_queries, turn_keys, scores, probabilities, accumulate, flag_rows, finish

