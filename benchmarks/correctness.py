"""The correctness gate: every figure is of an output checked first against the float64 reference tier.

:func:`sample_rows` picks query rows to check within a host budget, :func:`reference_rows` computes their
reference from only the KV they see, and :func:`check_output` compares an output with it through the tolerance
table. :func:`fill_nan` and :func:`poison_allocator` fill the output and the allocator's free memory with NaN
first, so a call that writes nothing cannot pass on a stale answer.
"""

from __future__ import annotations

import numpy as np

import bsrattn as ba
from bsrattn.testing import compare, tolerance

# Host float64 copies of the checked KV rows are kept under this many elements (K and V each).
CHECK_ELEMENTS = 1 << 26


def _query_rows(layout):
    """``[nnz_qo]`` block row of each query row."""
    return np.repeat(np.arange(layout.num_rows), layout.qo_lens)


def visible_slots(layout, i: int, causal: bool) -> np.ndarray:
    """Pool slots query row ``i`` attends: its row's slots, cut at its logical position when causal."""
    r = int(_query_rows(layout)[i])
    slots = layout.kv_slots(r)
    if causal:
        pos = int(layout.kv_lens[r]) - int(layout.qo_lens[r]) + (i - int(layout.qo_indptr[r]))
        slots = slots[:max(pos + 1, 0)]
    return slots


def sample_rows(layout, num_kv_heads: int, head_dim: int, *, causal: bool = False, max_rows: int = 32,
                max_elements: int = CHECK_ELEMENTS) -> np.ndarray:
    """Query rows to check: spread over the batch (first, last, then evenly between), within a host budget.

    Rows are added while the distinct KV slots they see (``x num_kv_heads x head_dim`` elements; a slot two
    rows share, such as a shared prefix, counts once) fit in ``max_elements``; the first row is always kept.
    """
    n = layout.nnz_qo
    spread = np.unique(np.linspace(0, n - 1, min(max_rows, n)).round().astype(np.int64))
    order = [int(spread[0])] + ([int(spread[-1])] if spread.size > 1 else []) + [int(i) for i in spread[1:-1]]
    seen = np.zeros(layout.num_slots, dtype=bool)
    rows, used = [], 0
    for i in order:
        slots = visible_slots(layout, i, causal)
        cost = int(np.count_nonzero(~seen[slots])) * num_kv_heads * head_dim
        if rows and used + cost > max_elements:
            continue
        seen[slots] = True
        rows.append(i)
        used += cost
    return np.array(sorted(rows), dtype=np.int64)


def _index(x, idx: np.ndarray):
    """``idx`` as an index of ``x``: a torch tensor on ``x``'s device for torch, the array itself for NumPy."""
    if hasattr(x, "detach"):
        import torch

        return torch.as_tensor(idx, dtype=torch.int64, device=x.device)
    return idx


def _take_slots(x, kv_layout: str, block_size: int, slots: np.ndarray):
    """``[n, num_kv_heads, head_dim]``: the KV rows at pool ``slots`` of ``x`` in its storage layout."""
    if kv_layout == "HND":
        return x[_index(x, slots // block_size), :, _index(x, slots % block_size), :]
    return x.reshape(-1, x.shape[-2], x.shape[-1])[_index(x, slots)]


def _float64(x, scale=None) -> np.ndarray:
    if hasattr(x, "detach"):
        import torch

        x = x.detach().to(dtype=torch.float64).cpu().numpy()
    else:
        x = np.asarray(x, dtype=np.float64)
    return x * scale if scale is not None else x


def reference_rows(layout, q, k, v, rows, *, kv_layout: str = "NHD", causal: bool = False, k_scale=None,
                   v_scale=None, variant=None) -> np.ndarray:
    """float64 reference output ``[len(rows), num_qo_heads, head_dim]`` of query rows ``rows``.

    Gathers only the KV slots those rows see (from torch tensors on any device, or NumPy arrays), dequantises
    fp8 with its scale exactly as the reference tier does (``x.astype(f64) * scale``), and runs the reference
    tier on a vector-sparse layout of one query per row. A causal row keeps the keys up to its logical
    position, so the result equals that row of the full attention (see the tests). Each key keeps its logical
    position there (the query sits after the keys it sees), so a variant of positions (window, ALiBi) gives
    the same row too.

    Parameters
    ----------
    layout : BSRLayout
    q : ``[nnz_qo, num_qo_heads, head_dim]``
    k, v : the pool in ``kv_layout`` storage: NHD ``[num_blocks, block_size, Hkv, D]`` (or ``[N, Hkv, D]``), or
        HND ``[num_blocks, Hkv, block_size, D]``
    rows : ``[n]`` query row indices
    variant : Variant, optional
        Applied to every row (``causal`` is what cuts the keys; the variant's own ``causal`` hides none of them).
    """
    lists = [visible_slots(layout, int(i), causal) for i in rows]
    # Each distinct slot is gathered once (rows of a shared prefix or of one causal request overlap).
    slots, position = np.unique(np.concatenate(lists) if lists else np.zeros(0, np.int64), return_inverse=True)
    k_rows = _float64(_take_slots(k, kv_layout, layout.block_size, slots), k_scale)
    v_rows = _float64(_take_slots(v, kv_layout, layout.block_size, slots), v_scale)
    offsets = np.concatenate([[0], np.cumsum([s.size for s in lists])])
    sub = ba.layouts.vector_sparse([position[offsets[j]:offsets[j + 1]] for j in range(len(lists))],
                                   np.ones(len(lists), dtype=np.int64), num_slots=int(slots.size))
    q_rows = _float64(q[_index(q, np.asarray(rows, dtype=np.int64))])
    return ba.attention(q_rows, k_rows, v_rows, sub, variant=variant, backend="reference")


def _as_tensor(y):
    """The output of a call as a torch tensor (tuples give their first element; Numba arrays are wrapped)."""
    import torch

    if isinstance(y, (tuple, list)):
        y = y[0]
    if isinstance(y, torch.Tensor):
        return y
    if hasattr(y, "__cuda_array_interface__"):
        return torch.as_tensor(y, device="cuda")
    return torch.as_tensor(np.asarray(y))


def check_output(y, *, shape, rows, expected, dtype: str, view=None) -> dict:
    """Compare rows ``rows`` of output ``y`` (after ``view``, reshaped to ``shape``) with ``expected``."""
    import torch

    t = _as_tensor(y)
    if view is not None:
        t = view(t)
    t = t.reshape(shape)[torch.as_tensor(rows, device=t.device)]
    atol, rtol = tolerance("attention", dtype)
    result = compare(t, expected, atol, rtol)
    return {"ok": bool(result.ok), "max_abs_err": result.max_abs, "rows_checked": int(len(rows)),
            "atol": atol, "rtol": rtol, "message": result.message}


def fill_nan(y):
    _as_tensor(y).fill_(float("nan"))


def poison_allocator(nbytes: int):
    """Fill the caching allocator's free memory with NaN, so an output it hands out holds no stale answer.

    After ``empty_cache`` the only free blocks are the ones made here: one large block for large outputs and
    a few 1 MiB blocks, which fill the small pool's 2 MiB segments.
    """
    import torch

    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    size = int(min(max(nbytes, 64 << 20), free // 4)) // 2 * 2
    blocks = [torch.empty(size // 2, dtype=torch.float16, device="cuda")]
    blocks += [torch.empty(1 << 19, dtype=torch.float16, device="cuda") for _ in range(8)]
    for b in blocks:
        b.fill_(float("nan"))
    torch.cuda.synchronize()
    del blocks
