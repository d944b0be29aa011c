"""Constructors: every KV-cache layout a serving engine uses, as one :class:`~bsrattn.BSRLayout`.

| layout | block size Bc | rows | what the indices are |
|---|---|---|---|
| :func:`dense` / :func:`ragged` | 1 | one per request | consecutive slots (the affine path) |
| :func:`paged` | page size | one per request | the page table |
| :func:`block_sparse` | C | one per block row of R queries | column blocks |
| :func:`vector_sparse` | 1 | one per request | the kept token slots (KV pruning) |
| :func:`quest` | page size | one per (request, KV head) | each head's selected pages |
| :func:`tree` | page size | one per request | the page table, plus a tree mask |
| :func:`shared_prefix` | page size | a :class:`~bsrattn.Cascade` | prefix level (all queries in one row) + suffixes |

Every length, index and size argument must hold integers (Python ints or NumPy integers, within int32):
floats are refused with ``TypeError``, even integral ones like ``2.0``, and so are bools, so that a
fractional or NaN id is never truncated to a valid one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from bsrattn import indexing
from bsrattn._types import Array
from bsrattn.cascade import Cascade
from bsrattn.coerce import INT32_MAX, as_index_array, as_int, as_lengths, indptr_of
from bsrattn.layout import BSRLayout

__all__ = ["dense", "ragged", "paged", "block_sparse", "vector_sparse", "quest", "tree", "shared_prefix",
           "per_head_views"]


def _check_rows(name, values, count, of):
    """Refuse ``values`` unless it is a sequence of ``count`` rows (one per request), naming ``name``."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"{name} must be a sequence with one entry per request, got {type(values).__name__}")
    if len(values) != count:
        raise ValueError(f"{name} has {len(values)} rows, {of} has {count}")


def _rows(name, values, count, of):
    """``values`` as a list of ``count`` rows (one per request), or an error naming ``name``."""
    _check_rows(name, values, count, of)
    return list(values)


def _row(name, values):
    """One row of ``name`` (a page table, a token list, a tree) as a flat integer array.

    Only its dtype is checked here; its entries' range is checked where they are used (page ids with the
    layout's indices, once for all rows).
    """
    try:
        arr = np.asarray(values)
    except ValueError:  # a ragged nested row: as_index_array says so
        arr = None
    if arr is None or arr.dtype.kind not in "iu":
        arr = as_index_array(name, values)
    return arr.reshape(-1)


def _short_table(tables_name, b, size, lens_name, kv_len, needed) -> str:
    return f"{tables_name}[{b}] has {size} pages, {lens_name}[{b}]={kv_len} needs {needed}"


def _leading_pages(tables, n_pages, kv_lens, tables_name, lens_name) -> np.ndarray:
    """The first ``n_pages[b]`` entries of each row of a ``[B, max_pages]`` integer page table, rows in order: the
    page table as engines keep it, read without a Python loop over the requests."""
    short = n_pages > tables.shape[1]
    if short.any():
        b = int(np.argmax(short))
        raise ValueError(_short_table(tables_name, b, tables.shape[1], lens_name, kv_lens[b], n_pages[b]))
    return tables[np.arange(tables.shape[1]) < n_pages[:, None]]


def _check_total(name, lengths):
    """Refuse lengths whose sum, the size of an int32-indexed array the layout builds, overflows int32."""
    total = int(lengths.sum())
    if total > INT32_MAX:
        raise ValueError(f"{name} sum to {total}, more than int32 holds ({INT32_MAX})")
    return total


def _last_len(kv_lens, block_size):
    return np.where(kv_lens > 0, kv_lens - (indexing.ceil_div(kv_lens, block_size) - 1) * block_size, 0)


def _paged_layout(qo_lens, kv_lens, indices, page_size, num_pages, custom_mask=None) -> BSRLayout:
    """The paged layout whose rows' pages, ``ceil(kv_lens[b] / page_size)`` of row ``b``, are ``indices`` in row
    order (lengths as int arrays): :func:`paged` once the tables are read, and the layout of callers that keep
    their tables themselves (``bsrattn.integrations``)."""
    return BSRLayout(indptr_of(qo_lens), indptr_of(indexing.ceil_div(kv_lens, page_size)), indices,
                     _last_len(kv_lens, page_size), page_size, num_pages, custom_mask)


def ragged(qo_lens: ArrayLike, kv_lens: ArrayLike) -> BSRLayout:
    """Variable-length requests, each with its KV contiguous in one ``[sum(kv_lens), H, D]`` buffer (Bc=1).

    Parameters
    ----------
    qo_lens : array_like of int, ``[B]``
        Query rows of each request.
    kv_lens : array_like of int, ``[B]``
        KV slots of each request, back to back in the buffer.

    Returns
    -------
    BSRLayout

    Raises
    ------
    TypeError
        A length or id that is not an integer (see the module docstring).
    ValueError
        Lengths that are negative, not 1-D, of different counts, or that sum beyond int32.

    Examples
    --------
    >>> import bsrattn as ba
    >>> ba.layouts.ragged([2, 1], [5, 3]).kv_slots(1).tolist()
    [5, 6, 7]
    """
    kv_lens = as_lengths("kv_lens", kv_lens)
    qo_lens = as_lengths("qo_lens", qo_lens, kv_lens.size, "kv_lens")
    _check_total("qo_lens", qo_lens)
    total = _check_total("kv_lens", kv_lens)  # before the [sum(kv_lens)] indices are made
    return BSRLayout(indptr_of(qo_lens), indptr_of(kv_lens), np.arange(total), np.minimum(kv_lens, 1), 1, total)


def dense(qo_len: int, kv_len: int) -> BSRLayout:
    """One request: ``qo_len`` queries over ``kv_len`` contiguous keys (plain attention).

    Parameters
    ----------
    qo_len : int
        Query rows.
    kv_len : int
        Keys, at pool slots ``0..kv_len-1``.

    Returns
    -------
    BSRLayout

    Raises
    ------
    TypeError
        A length that is not an int.
    ValueError
        A negative length.

    Examples
    --------
    >>> import bsrattn as ba
    >>> lay = ba.layouts.dense(2, 5)
    >>> lay.num_rows, lay.kv_slots(0).tolist()
    (1, [0, 1, 2, 3, 4])
    """
    return ragged([as_int("qo_len", qo_len, minimum=0)], [as_int("kv_len", kv_len, minimum=0)])


def paged(qo_lens: ArrayLike, page_tables: Sequence[ArrayLike], kv_lens: ArrayLike, page_size: int,
          num_pages: int) -> BSRLayout:
    """A paged KV cache: Bc = page size, and the indices array is the page table.

    Parameters
    ----------
    qo_lens : sequence of int, ``[B]``
        Query rows of each request.
    page_tables : sequence of sequences of int, ``[B][>= ceil(kv_len/page_size)]``
        Pool pages of each request in order; entries past ``ceil(kv_len / page_size)`` are ignored.
    kv_lens : sequence of int, ``[B]``
        Tokens in each request's cache.
    page_size, num_pages : int
        Slots per page (Bc) and pages in the pool (``num_blocks``).

    Returns
    -------
    BSRLayout

    Raises
    ------
    TypeError
        A length or id that is not an integer (see the module docstring).
    ValueError
        Negative lengths, counts that differ, a page table shorter than its ``kv_len`` needs, a page id outside
        ``[0, num_pages)``, a ``page_size`` below 1.

    Examples
    --------
    >>> import bsrattn as ba
    >>> lay = ba.layouts.paged([1], [[7, 2]], kv_lens=[20], page_size=16, num_pages=8)
    >>> lay.kv_last_len.tolist(), lay.kv_slots(0)[15:17].tolist()
    ([4], [127, 32])
    """
    return _paged(qo_lens, page_tables, kv_lens, page_size, num_pages)


def _paged(qo_lens, page_tables, kv_lens, page_size, num_pages, tables_name="page_tables", lens_name="kv_lens"):
    """:func:`paged`, its errors naming the caller's arguments (:func:`shared_prefix` passes its own names)."""
    kv_lens = as_lengths(lens_name, kv_lens)
    qo_lens = as_lengths("qo_lens", qo_lens, kv_lens.size, lens_name)
    _check_rows(tables_name, page_tables, kv_lens.size, lens_name)
    page_size = as_int("page_size", page_size, minimum=1)
    num_pages = as_int("num_pages", num_pages, minimum=0)
    _check_total("qo_lens", qo_lens)
    n_pages = indexing.ceil_div(kv_lens, page_size)
    if isinstance(page_tables, np.ndarray) and page_tables.ndim == 2 and page_tables.dtype.kind in "iu":
        indices = _leading_pages(page_tables, n_pages, kv_lens, tables_name, lens_name)
    else:
        tables = []
        for b, table in enumerate(page_tables):
            table = _row(f"{tables_name}[{b}]", table)
            if table.size < n_pages[b]:
                raise ValueError(_short_table(tables_name, b, table.size, lens_name, kv_lens[b], n_pages[b]))
            tables.append(table[:n_pages[b]])
        indices = np.concatenate(tables) if tables else np.zeros(0, np.int64)
    return _paged_layout(qo_lens, kv_lens, indices, page_size, num_pages)


def block_sparse(indptr: ArrayLike, indices: ArrayLike, M: int, N: int, R: int, C: int,
                 mask: ArrayLike | None = None) -> BSRLayout:
    """FlashInfer's ``BlockSparseAttention`` form: an ``[M, N]`` matrix of ``R x C`` blocks.

    Parameters
    ----------
    indptr : array_like of int, ``[M/R + 1]``
        Block row ``i`` holds column blocks ``indices[indptr[i]:indptr[i+1]]``.
    indices : array_like of int, ``[nnz]``
        Column block ids in ``[0, N/C)``.
    M, N, R, C : int
        Query rows, key columns, block height and block width (``M % R == 0``, ``N % C == 0``).
    mask : array of bool, optional ``[nnz, R, C]``
        Element masks of the non-zero blocks.

    Returns
    -------
    BSRLayout
        ``block_size = C``, one row per block row of ``R`` queries.

    Raises
    ------
    TypeError
        A size or id that is not an integer, a ``mask`` that is not bool.
    ValueError
        ``M % R`` or ``N % C`` not 0, ``indptr`` not ``[M/R + 1]`` or not a valid indptr, an id outside
        ``[0, N/C)``, a ``mask`` not ``[nnz, R, C]``.

    Notes
    -----
    ``k`` and ``v`` are an ``[N, num_kv_heads, head_dim]`` buffer viewed as ``[N/C, C, num_kv_heads, head_dim]``
    (3-D ``k``/``v`` are accepted for ``C == 1`` only). Positions within a block row are its listed keys in
    order, so position masks (causal) count the row's gathered keys, not matrix columns.

    Examples
    --------
    >>> import bsrattn as ba
    >>> lay = ba.layouts.block_sparse([0, 1, 3], [0, 0, 1], M=8, N=8, R=4, C=4)   # 2 block rows of 4 queries
    >>> lay.block_occupancy(4, 4).astype(int).tolist()
    [[1, 0], [1, 1]]
    """
    M, N = as_int("M", M, minimum=0), as_int("N", N, minimum=0)
    R, C = as_int("R", R, minimum=1), as_int("C", C, minimum=1)
    if M % R or N % C:
        raise ValueError(f"need M % R == 0 and N % C == 0 with R, C >= 1; got M={M}, N={N}, R={R}, C={C}")
    rows = M // R
    indptr = as_index_array("indptr", indptr).astype(np.int64)
    indices = as_index_array("indices", indices)
    if indptr.shape != (rows + 1,):
        raise ValueError(f"indptr has shape {indptr.shape}, expected [M/R + 1]=[{rows + 1}]")
    nblocks = np.diff(indptr)
    custom = None
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype != bool:
            raise TypeError(f"mask must be bool, got dtype {mask.dtype}")
        nnz = int(indptr[-1])
        if mask.shape != (nnz, R, C):
            raise ValueError(f"mask has shape {mask.shape}, expected [nnz, R, C]=[{nnz}, {R}, {C}]")
        custom = np.concatenate([mask[indptr[i]:indptr[i + 1]].transpose(1, 0, 2).reshape(-1)
                                 for i in range(rows)]) if rows else np.zeros(0, bool)
    return BSRLayout(np.arange(rows + 1) * R, indptr, indices, np.where(nblocks > 0, C, 0), C, N // C, custom)


def vector_sparse(token_indices: Sequence[ArrayLike], qo_lens: ArrayLike, num_slots: int) -> BSRLayout:
    """KV pruning (H2O, Quest at token level): each request keeps a scattered list of slots (Bc=1).

    Parameters
    ----------
    token_indices : sequence of sequences of int, ``[B][kv_len_b]``
        The pool slots each request keeps, in the order it reads them.
    qo_lens : array_like of int, ``[B]``
        Query rows of each request.
    num_slots : int
        Slots in the pool.

    Returns
    -------
    BSRLayout

    Raises
    ------
    TypeError
        A length or id that is not an integer (see the module docstring).
    ValueError
        Negative lengths, counts that differ, a slot outside ``[0, num_slots)``.

    Examples
    --------
    >>> import bsrattn as ba
    >>> ba.layouts.vector_sparse([[9, 2, 5]], [1], num_slots=16).kv_slots(0).tolist()
    [9, 2, 5]
    """
    qo_lens = as_lengths("qo_lens", qo_lens)
    tokens = [_row(f"token_indices[{b}]", t) for b, t in enumerate(_rows("token_indices", token_indices,
                                                                         qo_lens.size, "qo_lens"))]
    return BSRLayout.from_slots(tokens, qo_lens, as_int("num_slots", num_slots, minimum=0))


def quest(page_tables: Sequence[ArrayLike], kv_lens: ArrayLike, selected_pages: Sequence[Sequence[ArrayLike]],
          page_size: int, num_pages: int, num_kv_heads: int) -> BSRLayout:
    """Per-head page selection (Quest) for decode: one row per (request, KV head).

    Each KV head of each request attends only its own selected pages. The layout addresses the KV cache in
    HND form viewed per head: ``k`` of shape ``[num_pages, num_kv_heads, page_size, head_dim]`` viewed as
    ``[num_pages * num_kv_heads, page_size, 1, head_dim]``, where page ``p`` of head ``h`` is block
    ``p * num_kv_heads + h``; the query ``[B, num_qo_heads, D]`` is viewed as ``[B * num_kv_heads, G, D]``.
    :func:`per_head_views` makes both views.

    Parameters
    ----------
    page_tables : sequence of sequences of int, ``[B][n_pages_b]``
        Pool pages of each request.
    kv_lens : sequence of int, ``[B]``
        Tokens in each request.
    selected_pages : nested sequence of int, ``[B][num_kv_heads][budget]``
        Logical page numbers (indices into the page table) each head keeps, in increasing order. A selected
        partial last page must come last.
    page_size, num_pages, num_kv_heads : int
        Slots per page, pages in the pool, and KV heads (each head one row per request).

    Returns
    -------
    BSRLayout
        ``B * num_kv_heads`` rows of one query each, over ``num_pages * num_kv_heads`` blocks.

    Raises
    ------
    TypeError
        A length or id that is not an integer (see the module docstring).
    ValueError
        Counts that differ, a page table shorter than its ``kv_len`` needs, a head count that is not
        ``num_kv_heads``, selected pages outside the request's pages or not strictly increasing.

    Examples
    --------
    >>> import bsrattn as ba
    >>> lay = ba.layouts.quest([[4, 1, 3, 0]], kv_lens=[60], selected_pages=[[[0, 3], [1, 3]]], page_size=16,
    ...                        num_pages=5, num_kv_heads=2)
    >>> lay.num_rows, lay.kv_indices.tolist(), lay.kv_last_len.tolist()   # block = pool page * Hkv + head
    (2, [8, 0, 3, 1], [12, 12])
    """
    kv_lens = as_lengths("kv_lens", kv_lens)
    batch = kv_lens.size
    page_tables = _rows("page_tables", page_tables, batch, "kv_lens")
    selected_pages = _rows("selected_pages", selected_pages, batch, "kv_lens")
    page_size = as_int("page_size", page_size, minimum=1)
    num_pages = as_int("num_pages", num_pages, minimum=0)
    num_kv_heads = as_int("num_kv_heads", num_kv_heads, minimum=1)
    n_pages = indexing.ceil_div(kv_lens, page_size)
    last_len = _last_len(kv_lens, page_size)
    indices, kv_indptr, kv_last = [], [0], []
    for b in range(batch):
        table = _row(f"page_tables[{b}]", page_tables[b]).astype(np.int64)  # scaled by num_kv_heads below
        if table.size < n_pages[b]:
            raise ValueError(f"page_tables[{b}] has {table.size} pages, kv_lens[{b}]={kv_lens[b]} needs {n_pages[b]}")
        if len(selected_pages[b]) != num_kv_heads:
            raise ValueError(f"selected_pages[{b}] has {len(selected_pages[b])} heads, expected {num_kv_heads}")
        for h in range(num_kv_heads):
            sel = _row(f"selected_pages[{b}][{h}]", selected_pages[b][h]).astype(np.int64)
            if sel.size and (sel.min() < 0 or sel.max() >= n_pages[b]):
                raise ValueError(f"selected_pages[{b}][{h}] has pages outside [0, {n_pages[b]})")
            if (np.diff(sel) <= 0).any():
                raise ValueError(f"selected_pages[{b}][{h}] must be strictly increasing")
            indices.append(table[sel] * num_kv_heads + h)
            kv_indptr.append(kv_indptr[-1] + sel.size)
            kv_last.append(0 if sel.size == 0 else (last_len[b] if sel[-1] == n_pages[b] - 1 else page_size))
    rows = batch * num_kv_heads
    return BSRLayout(np.arange(rows + 1), kv_indptr, np.concatenate(indices) if indices else np.zeros(0, np.int64),
                     kv_last, page_size, num_pages * num_kv_heads)


def per_head_views(q: Array, k: Array, v: Array, num_kv_heads: int) -> tuple[Array, Array, Array]:
    """Views of decode ``q [B, Hq, D]`` and HND ``k, v [P, Hkv, page, D]`` for a :func:`quest` layout.

    Returns ``q [B*Hkv, Hq/Hkv, D]`` and ``k, v [P*Hkv, page, 1, D]`` (no copies for contiguous inputs).
    Reshape the output back with ``out.reshape(B, Hq, D)``.

    Parameters
    ----------
    q : array, ``[B, num_qo_heads, head_dim]``
        Decode queries, one per request.
    k, v : arrays, ``[num_pages, num_kv_heads, page_size, head_dim]``
        The HND KV pool.
    num_kv_heads : int
        KV heads of ``k`` and ``v``.

    Returns
    -------
    (q, k, v)
        ``q [B*num_kv_heads, num_qo_heads/num_kv_heads, head_dim]`` and ``k``, ``v``
        ``[num_pages*num_kv_heads, page_size, 1, head_dim]``, of the inputs' array kind.

    Raises
    ------
    TypeError
        ``num_kv_heads`` not an int.
    ValueError
        ``num_kv_heads`` below 1, ``q`` not 3-D, ``num_qo_heads`` not a multiple of ``num_kv_heads``, ``k``/``v``
        not HND with ``num_kv_heads`` heads or of different shapes.

    Examples
    --------
    >>> import numpy as np, bsrattn as ba
    >>> q, k, v = np.zeros((3, 8, 16)), np.zeros((5, 2, 16, 16)), np.zeros((5, 2, 16, 16))
    >>> [x.shape for x in ba.layouts.per_head_views(q, k, v, num_kv_heads=2)]
    [(6, 4, 16), (10, 16, 1, 16), (10, 16, 1, 16)]
    """
    num_kv_heads = as_int("num_kv_heads", num_kv_heads, minimum=1)
    if len(q.shape) != 3:
        raise ValueError(f"q must be decode queries [B, num_qo_heads, head_dim]; got shape {tuple(q.shape)}")
    if len(k.shape) != 4 or k.shape[1] != num_kv_heads or v.shape != k.shape:
        raise ValueError(f"k, v must be HND [P, {num_kv_heads}, page, D]; got {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"num_qo_heads={q.shape[1]} is not a multiple of num_kv_heads={num_kv_heads}")
    group_size = q.shape[1] // num_kv_heads
    page_size, head_dim = k.shape[2], k.shape[3]
    return (q.reshape(q.shape[0] * num_kv_heads, group_size, q.shape[2]),
            k.reshape(k.shape[0] * num_kv_heads, page_size, 1, head_dim),
            v.reshape(v.shape[0] * num_kv_heads, page_size, 1, head_dim))


def tree(parents: Sequence[ArrayLike], page_tables: Sequence[ArrayLike], kv_lens: ArrayLike, page_size: int,
         num_pages: int) -> BSRLayout:
    """Speculative tree decoding: the draft tree's tokens as queries under a tree mask.

    Request ``b`` has a draft tree of ``n_b = len(parents[b])`` nodes stored as the last ``n_b`` of its
    ``kv_lens[b]`` KV slots, in node order; ``parents[b][i]`` is node ``i``'s parent (``-1`` for a root,
    else ``< i``). Node ``i`` is query row ``i`` and attends every committed token (the first
    ``kv_lens[b] - n_b`` slots), its ancestors and itself.

    Parameters
    ----------
    parents : sequence of sequences of int, ``[B][n_b]``
        Each request's draft tree, ``parents[b][i]`` the parent of node ``i`` (``-1`` for a root).
    page_tables : sequence of sequences of int, ``[B][>= ceil(kv_len/page_size)]``
        Pool pages of each request in order, as in :func:`paged`.
    kv_lens : sequence of int, ``[B]``
        Tokens in each request's cache, its tree's nodes included.
    page_size, num_pages : int
        Slots per page (Bc) and pages in the pool.

    Returns
    -------
    BSRLayout
        A paged layout with the tree mask as its ``custom_mask``.

    Raises
    ------
    TypeError
        A length or id that is not an integer (see the module docstring).
    ValueError
        A tree with more nodes than its ``kv_len``, a parent not in ``-1..i-1``, and :func:`paged`'s errors.

    Examples
    --------
    >>> import bsrattn as ba
    >>> lay = ba.layouts.tree([[-1, 0, 0]], [[0]], kv_lens=[5], page_size=8, num_pages=1)
    >>> lay.row_mask(0).astype(int).tolist()
    [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]
    """
    kv_lens = as_lengths("kv_lens", kv_lens)
    trees = [_row(f"parents[{b}]", par) for b, par in enumerate(_rows("parents", parents, kv_lens.size, "kv_lens"))]
    for b, par in enumerate(trees):
        n = par.size
        if n > kv_lens[b]:
            raise ValueError(f"tree {b} has {n} nodes but kv_lens[{b}]={kv_lens[b]}")
        if ((par >= np.arange(n)) | (par < -1)).any():
            raise ValueError(f"parents[{b}] must satisfy -1 <= parents[i] < i, got {par.tolist()}")
    qo_lens = np.array([par.size for par in trees], dtype=np.int64)
    base = paged(qo_lens, page_tables, kv_lens, page_size, num_pages)
    _check_total("the tree masks' sizes (nodes x kv_lens)", qo_lens * kv_lens)  # before the masks are made
    masks = []
    for b, par in enumerate(trees):
        n = par.size
        prefix = kv_lens[b] - n
        mask = np.zeros((n, kv_lens[b]), dtype=bool)
        mask[:, :prefix] = True
        for i in range(n):
            node = i
            while node >= 0:
                mask[i, prefix + node] = True
                node = par[node]
        masks.append(mask.reshape(-1))
    return BSRLayout(base.qo_indptr, base.kv_indptr, base.kv_indices, base.kv_last_len, page_size, num_pages,
                     np.concatenate(masks) if masks else np.zeros(0, bool))


def shared_prefix(qo_lens: ArrayLike, prefix_pages: ArrayLike, prefix_len: int,
                  suffix_page_tables: Sequence[ArrayLike], suffix_lens: ArrayLike, page_size: int,
                  num_pages: int) -> Cascade:
    """A prefix shared by every request, then per-request suffixes: a two-level :class:`~bsrattn.Cascade`.

    Level 0 puts every request's queries in one block row over the prefix pages, so they share one load of
    the prefix; level 1 is a plain paged layout of the suffixes (``Br = 1`` per request). Both index the
    same KV pool; their states merge with ⊕.

    Parameters
    ----------
    qo_lens : sequence of int, ``[B]``
        Query rows of each request.
    prefix_pages : sequence of int, ``[>= ceil(prefix_len/page_size)]``
        Pool pages of the shared prefix, in order.
    prefix_len : int
        Tokens of the shared prefix.
    suffix_page_tables : sequence of sequences of int, ``[B][>= ceil(suffix_len/page_size)]``
        Pool pages of each request's own suffix, in order.
    suffix_lens : sequence of int, ``[B]``
        Tokens of each request's suffix.
    page_size, num_pages : int
        Slots per page (Bc) and pages in the pool.

    Returns
    -------
    Cascade
        Two levels: the prefix (one row of every query), then the suffixes (one row per request).

    Raises
    ------
    TypeError
        A length or id that is not an integer (see the module docstring).
    ValueError
        ``prefix_pages`` shorter than ``prefix_len`` needs, and :func:`paged`'s errors on the suffixes.

    Examples
    --------
    >>> import bsrattn as ba
    >>> c = ba.layouts.shared_prefix([1, 1], [0, 1], 32, [[2], [3]], [5, 9], page_size=16, num_pages=4)
    >>> [lvl.num_rows for lvl in c.levels], c.levels[0].kv_lens.tolist()
    ([1, 2], [32])
    """
    qo_lens = as_lengths("qo_lens", qo_lens)
    prefix_pages = _row("prefix_pages", prefix_pages)
    prefix_len = as_int("prefix_len", prefix_len, minimum=0)
    page_size = as_int("page_size", page_size, minimum=1)
    if prefix_pages.size < indexing.ceil_div(prefix_len, page_size):
        raise ValueError(f"prefix_pages has {prefix_pages.size} pages, prefix_len={prefix_len} needs "
                         f"{indexing.ceil_div(prefix_len, page_size)}")
    suffix = _paged(qo_lens, suffix_page_tables, suffix_lens, page_size, num_pages, "suffix_page_tables",
                    "suffix_lens")
    prefix = paged([_check_total("qo_lens", qo_lens)], [prefix_pages], [prefix_len], page_size, num_pages)
    return Cascade((prefix, suffix))
