"""The plan half of plan/run: FlashInfer's load-balancing scheduler (Algorithm 1), on the host.

``plan`` splits each query tile's KV into chunks, sorts the resulting work items longest first and gives
each to the least-loaded CTA (a min-heap). A tile split into several chunks writes one partial attention
state per chunk into a workspace slot, and a merge list folds them afterwards **in chunk order**, never in
completion order, so the result is deterministic. Everything is a pure function of the lengths.

A :class:`WorkPlan` is plain int32 arrays a kernel can read: CTA ``c`` of its ``num_ctas`` (per KV head, as
:meth:`bsrattn.BatchAttention.plan` says) runs items ``cta_indptr[c]:cta_indptr[c+1]`` in order.

:func:`round_robin` is the baseline Algorithm 1 is measured against; the makespan study (:func:`makespan`,
:func:`simulate`'s :class:`SimulationResult`, :data:`DISTRIBUTIONS`) is :mod:`bsrattn.makespan`, its names
re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from bsrattn.coerce import INT32_MAX, as_int, as_lengths
from bsrattn.compiled import Compiled
from bsrattn.indexing import ceil_div
from bsrattn.layout import BSRLayout
from bsrattn.makespan import DISTRIBUTIONS, SimulationResult, compare, makespan

__all__ = ["WorkPlan", "plan", "plan_layout", "round_robin", "makespan", "simulate", "SimulationResult",
           "DISTRIBUTIONS"]

MAX_CTAS = 2**20
"""The largest ``num_ctas`` a plan may have: a GPU runs a few thousand CTAs at once, so more only add empty ones."""


@dataclass(frozen=True, eq=False)
class WorkPlan:
    """Work items per CTA, partial-state slots and merge lists, as arrays a kernel reads.

    Attributes
    ----------
    num_ctas, tile_q : int
        CTAs per KV head; query rows per tile.
    kv_chunk_size : int
        KV slots per chunk (0 when splitting is disabled).
    cta_indptr : ``[num_ctas+1]``
        CTA ``c`` runs items ``cta_indptr[c]:cta_indptr[c+1]``, in that order.
    item_row, item_qo_start, item_qo_end, item_kv_start, item_kv_end : ``[W]``
        Item ``w`` attends query rows ``item_qo_start[w]:item_qo_end[w]`` (absolute rows of ``q``) of block
        row ``item_row[w]`` over its logical KV slots ``item_kv_start[w]:item_kv_end[w]``.
    item_partial : ``[W]``
        First workspace row of the item's partial state, or -1 when the item writes the output directly.
    item_cost : ``[W]``
        The cost model's value, ``q_rows + kv_slots``.
    merge_indptr : ``[M+1]``
        Merge ``m`` folds the partial states listed at ``merge_indptr[m]:merge_indptr[m+1]``.
    merge_partials : ``[P]``
        The listed partial states' first workspace rows.
    merge_qo_start, merge_qo_end : ``[M]``
        Merge ``m`` folds, for each query row ``merge_qo_start[m] + i``, the partial rows
        ``merge_partials[merge_indptr[m]:merge_indptr[m+1]] + i`` in that order, into the output.
    num_partial_rows : int
        Workspace rows the partial states need.

    Examples
    --------
    >>> import bsrattn as ba
    >>> p = ba.scheduler.plan([1, 1], [100, 10], num_ctas=4)
    >>> p.cta_indptr.tolist(), p.item_kv_start.tolist(), p.item_kv_end.tolist()
    ([0, 1, 2, 3, 5], [0, 28, 56, 84, 0], [28, 56, 84, 100, 10])
    >>> p.merge_partials[p.merge_indptr[0]:p.merge_indptr[1]].tolist()    # row 0's chunks, in chunk order
    [0, 1, 2, 3]
    """

    num_ctas: int
    tile_q: int
    kv_chunk_size: int
    cta_indptr: np.ndarray
    item_row: np.ndarray
    item_qo_start: np.ndarray
    item_qo_end: np.ndarray
    item_kv_start: np.ndarray
    item_kv_end: np.ndarray
    item_partial: np.ndarray
    item_cost: np.ndarray
    merge_indptr: np.ndarray
    merge_partials: np.ndarray
    merge_qo_start: np.ndarray
    merge_qo_end: np.ndarray
    num_partial_rows: int

    @property
    def num_items(self) -> int:
        """W, the number of work items."""
        return int(self.item_row.size)

    @property
    def num_merges(self) -> int:
        """M, the number of merge lists (one per split query tile)."""
        return int(self.merge_qo_start.size)

    def cta_loads(self, cost: ArrayLike | None = None) -> np.ndarray:
        """``[num_ctas]`` summed cost per CTA (``cost`` defaults to ``item_cost``).

        Parameters
        ----------
        cost : array_like of float, ``[W]``, optional
            Each item's cost; default ``item_cost``.

        Returns
        -------
        numpy.ndarray
            ``[num_ctas]`` float64.
        """
        cost = self.item_cost if cost is None else np.asarray(cost)
        owner = np.repeat(np.arange(self.num_ctas), np.diff(self.cta_indptr))
        return np.bincount(owner, weights=cost, minlength=self.num_ctas)

    def equals(self, other: WorkPlan) -> bool:
        """Bitwise equality of every field.

        Parameters
        ----------
        other : WorkPlan
            The plan to compare with.

        Returns
        -------
        bool
        """
        return all(np.array_equal(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))


def _check_lengths(qo_lens, kv_lens):
    """``[R]`` lengths (:func:`~bsrattn.coerce.as_lengths`) as int32 arrays, as a plan's arrays are."""
    kv = as_lengths("kv_lens", kv_lens)
    return as_lengths("qo_lens", qo_lens, kv.size, "kv_lens").astype(np.int32), kv.astype(np.int32)


def _check_options(num_ctas, tile_q, min_split_size=1, kv_align=1, fixed_split_size=None):
    """Raise unless ``num_ctas`` is an int in ``1..MAX_CTAS`` and the others ints in ``1..2**31-1`` (or
    ``fixed_split_size`` None): Python or NumPy integers, never bools or floats."""
    if as_int("num_ctas", num_ctas, minimum=1) > MAX_CTAS:
        raise ValueError(f"num_ctas must be <= {MAX_CTAS} (2**20), got {num_ctas}: a launch runs num_ctas x "
                         f"num_kv_heads programs and a GPU a few thousand at once, so the rest would be empty")
    for name, value in (("tile_q", tile_q), ("min_split_size", min_split_size), ("kv_align", kv_align),
                        ("fixed_split_size", fixed_split_size)):
        if value is not None and as_int(name, value, minimum=1) > INT32_MAX:
            raise ValueError(f"{name} must be <= {INT32_MAX}, got {value}: a plan's bounds are int32")


def _chunk_size(qo, kv, num_ctas, tile_q, split, min_split_size, kv_align):
    """KV slots per chunk for :func:`_plan_core`'s ``split``; 0 when splitting is disabled."""
    if split > 0:
        return split
    if split < 0:
        return 0
    total = 0
    for r in range(qo.size):
        total += ceil_div(qo[r], tile_q) * kv[r]
    size = max(ceil_div(total, num_ctas), min_split_size, 1)
    return ceil_div(size, kv_align) * kv_align


def _work_items(qo, kv, tile_q, chunk, lead):
    """Every (query tile, KV chunk) of every row, in (row, tile, chunk) order: ``[W]`` arrays of the item's row,
    query rows ``qs:qe``, KV slots ``ks:ke``, query tile, and whether that tile is split into several items.
    A row's first chunk holds ``lead`` slots (a multiple of ``chunk``), the others ``chunk``."""
    num_rows = qo.size
    chunks = np.ones(num_rows, np.int64)
    n_items = 0
    for r in range(num_rows):
        if chunk > 0:
            chunks[r] = 1 + ceil_div(max(0, kv[r] - lead), chunk)
        n_items += ceil_div(qo[r], tile_q) * chunks[r]
    row = np.empty(n_items, np.int64)
    qs = np.empty(n_items, np.int64)
    qe = np.empty(n_items, np.int64)
    ks = np.empty(n_items, np.int64)
    ke = np.empty(n_items, np.int64)
    tile = np.empty(n_items, np.int64)
    split_tile = np.empty(n_items, np.bool_)
    w = 0
    t = 0
    q_base = 0
    for r in range(num_rows):
        for q0 in range(q_base, q_base + qo[r], tile_q):
            for c in range(chunks[r]):
                row[w] = r
                qs[w] = q0
                qe[w] = min(q0 + tile_q, q_base + qo[r])
                ks[w] = 0 if c == 0 else lead + (c - 1) * chunk
                ke[w] = kv[r] if chunk == 0 else min(lead + c * chunk, kv[r])
                tile[w] = t
                split_tile[w] = chunks[r] > 1
                w += 1
            t += 1
        q_base += qo[r]
    return row, qs, qe, ks, ke, tile, split_tile


def _longest_first_least_loaded(cost, num_ctas):
    """Algorithm 1's assignment: ``(assigned, owner)``, the items in the order they were handed out, longest
    first, and each item's CTA, the least loaded when it was handed out (ties to the lower id)."""
    n_items = cost.size
    owner = np.empty(n_items, np.int64)
    # Equal costs keep item order, so the plan is a pure function. One int64 key per item, (cost descending,
    # item ascending), sorts faster than an argsort of the costs.
    longest = cost.max() if n_items else 0
    keys = (longest - cost) * n_items + np.arange(n_items)
    keys.sort()
    assigned = keys % max(n_items, 1)
    # A min-heap of CTAs keyed by load * num_ctas + cta: the least-loaded CTA on top, ties to the lower id.
    heap = np.arange(num_ctas)
    for i in range(n_items):
        item = assigned[i]
        owner[item] = heap[0] % num_ctas
        top = heap[0] + cost[item] * num_ctas
        # Sift the root's new key down.
        p = 0
        while True:
            child = 2 * p + 1
            if child >= num_ctas:
                break
            if child + 1 < num_ctas and heap[child + 1] < heap[child]:
                child += 1
            if heap[child] > top:
                break
            heap[p] = heap[child]
            p = child
        heap[p] = top
    return assigned, owner


def _round_robin(tile, num_ctas):
    """The baseline's assignment: ``(assigned, owner)``, items in item order, query tile ``i`` on CTA
    ``i % num_ctas``."""
    n_items = tile.size
    owner = np.empty(n_items, np.int64)
    for i in range(n_items):
        owner[i] = tile[i] % num_ctas
    return np.arange(n_items), owner


def _group_by_cta(assigned, owner, num_ctas):
    """``(cta_indptr [num_ctas+1], order [W])``: the items grouped by CTA; within a CTA, items run in the order
    they were assigned."""
    n_items = assigned.size
    cta_indptr = np.zeros(num_ctas + 1, np.int64)
    for i in range(n_items):
        cta_indptr[owner[i] + 1] += 1
    for c in range(num_ctas):
        cta_indptr[c + 1] += cta_indptr[c]
    order = np.empty(n_items, np.int64)
    fill = cta_indptr[:-1].copy()
    for i in range(n_items):
        item = assigned[i]
        order[fill[owner[item]]] = item
        fill[owner[item]] += 1
    return cta_indptr, order


def _partial_rows(qs, qe, tile, split_tile):
    """``(partial [W], n_partial_rows, n_merges, n_merge_items)``: workspace rows in item (= tile, chunk)
    order for the items of split tiles (-1 for the others), and the size of one merge per split tile."""
    n_items = qs.size
    partial = np.full(n_items, -1, np.int64)
    n_partial_rows = 0
    n_merges = 0
    n_merge_items = 0
    for i in range(n_items):
        if split_tile[i]:
            partial[i] = n_partial_rows
            n_partial_rows += qe[i] - qs[i]
            n_merge_items += 1
            if i == 0 or tile[i - 1] != tile[i]:
                n_merges += 1
    return partial, n_partial_rows, n_merges, n_merge_items


def _pack(cta_indptr, order, items, qs, qe, tile, split_tile, partial, n_merges, n_merge_items):
    """The plan as :func:`_plan_core`'s one flat int32 array; ``items`` are the seven item columns, which go in
    CTA order (``order``), and each split tile's merge folds its chunks in chunk order."""
    num_ctas = cta_indptr.size - 1
    n_items = order.size
    flat = np.empty(num_ctas + 1 + 7 * n_items + n_merges + 1 + n_merge_items + 2 * n_merges, np.int32)
    flat[:num_ctas + 1] = cta_indptr
    at = num_ctas + 1
    for column in items:
        for i in range(n_items):
            flat[at + i] = column[order[i]]
        at += n_items
    indptr_at = at
    partials_at = indptr_at + n_merges + 1
    qs_at = partials_at + n_merge_items
    qe_at = qs_at + n_merges
    flat[indptr_at] = 0
    m = -1
    j = 0
    for i in range(n_items):
        if split_tile[i]:
            if i == 0 or tile[i - 1] != tile[i]:
                m += 1
                flat[qs_at + m] = qs[i]
                flat[qe_at + m] = qe[i]
            flat[partials_at + j] = partial[i]
            j += 1
            flat[indptr_at + m + 1] = j
    return flat


def _plan_core(qo_lens, kv_lens, num_ctas, tile_q, split, min_split_size, kv_align, balance, lead_items):
    """Algorithm 1 with explicit loops (compiled by Numba when present); the plan comes back as one flat array.

    ``split`` is the KV chunk size when positive; 0 asks for Algorithm 1's
    ``L_kv = ceil(sum_r ceil(l_qo/T_q) * l_kv / num_ctas)``, at least ``min_split_size`` and rounded up to
    ``kv_align``; -1 disables splitting. With ``lead_items`` and a positive ``split``, a row's first chunk is that
    ``L_kv`` rounded up to a multiple of ``split``. ``balance`` selects Algorithm 1 (longest first onto the
    least-loaded CTA); otherwise query tile ``i`` goes to CTA ``i % num_ctas`` (round robin).

    Returns ``(flat, chunk, W, M, P, num_partial_rows)``. ``flat`` is int32: ``cta_indptr [num_ctas+1]``,
    the seven item arrays ``[W]`` (row, qo_start, qo_end, kv_start, kv_end, partial, cost) in CTA order,
    ``merge_indptr [M+1]``, ``merge_partials [P]``, ``merge_qo_start [M]`` and ``merge_qo_end [M]``, back to
    back (:func:`_make_plan` slices it): one array crosses into Python rather than twelve, each of which
    Numba would box separately.
    """
    # int64 from here on, whatever the callers' int width: sums and chunk ends must not wrap.
    qo = qo_lens.astype(np.int64)
    kv = kv_lens.astype(np.int64)
    chunk = _chunk_size(qo, kv, num_ctas, tile_q, split, min_split_size, kv_align)
    lead = chunk
    if lead_items and split > 0:
        lead = ceil_div(_chunk_size(qo, kv, num_ctas, tile_q, 0, min_split_size, kv_align), split) * split
    row, qs, qe, ks, ke, tile, split_tile = _work_items(qo, kv, tile_q, chunk, lead)
    cost = (qe - qs) + (ke - ks)
    if balance:
        assigned, owner = _longest_first_least_loaded(cost, num_ctas)
    else:
        assigned, owner = _round_robin(tile, num_ctas)
    cta_indptr, order = _group_by_cta(assigned, owner, num_ctas)
    partial, n_partial_rows, n_merges, n_merge_items = _partial_rows(qs, qe, tile, split_tile)
    flat = _pack(cta_indptr, order, (row, qs, qe, ks, ke, partial, cost), qs, qe, tile, split_tile, partial,
                 n_merges, n_merge_items)
    return flat, chunk, row.size, n_merges, n_merge_items, n_partial_rows


_core = Compiled(_plan_core, ceil_div, _chunk_size, _work_items, _longest_first_least_loaded, _round_robin,
                 _group_by_cta, _partial_rows, _pack)


def _make_plan(qo, kv, num_ctas, tile_q, split, min_split_size, kv_align, balance, lead_items=False,
               all_ctas=None) -> WorkPlan:
    """The :class:`WorkPlan` of checked int32 lengths ``qo``, ``kv`` over ``num_ctas`` CTAs of ``all_ctas`` (default
    ``num_ctas``; the others get no items); its arrays but ``cta_indptr``'s padding are views of one."""
    num_ctas, tile_q = int(num_ctas), int(tile_q)
    flat, chunk, w, m, p, rows = _core(qo, kv, num_ctas, tile_q, int(split), int(min_split_size), int(kv_align),
                                         balance, bool(lead_items))
    w, m, p = int(w), int(m), int(p)
    arrays = []
    at = 0
    for size in (num_ctas + 1, w, w, w, w, w, w, w, m + 1, p, m, m):
        arrays.append(flat[at:at + size])
        at += size
    if all_ctas is not None and all_ctas > num_ctas:
        indptr = arrays[0]
        arrays[0] = np.concatenate([indptr, np.full(all_ctas - num_ctas, indptr[-1], dtype=indptr.dtype)])
        num_ctas = all_ctas
    return WorkPlan(num_ctas, tile_q, int(chunk), *arrays, num_partial_rows=int(rows))


def _split(fixed_split_size, disable_split_kv) -> int:
    """:func:`_plan_core`'s ``split`` for :func:`plan`'s options."""
    if disable_split_kv:
        return -1
    return 0 if fixed_split_size is None else fixed_split_size


def plan(qo_lens: ArrayLike, kv_lens: ArrayLike, *, num_ctas: int, tile_q: int = 1, fixed_split_size: int | None = None,
         disable_split_kv: bool = False, min_split_size: int = 1, kv_align: int = 1,
         busy_ctas: int | None = None, lead_items: bool = False) -> WorkPlan:
    """FlashInfer's Algorithm 1: KV chunking, longest-first, least-loaded CTA, fixed merge order.

    Parameters
    ----------
    qo_lens, kv_lens : ``[R]`` ints
        Query rows and KV slots of each block row, in ``0..2**31-1``. Integers only: floats are refused,
        even integral ones like ``2.0``.
    num_ctas : int
        CTAs to balance over, ``1..MAX_CTAS`` (2**20).
    tile_q : int
        Query rows per tile, ``T_q``.
    fixed_split_size : int, optional
        Chunk size to use instead of ``L_kv``: chunk boundaries then depend on a row's own length only,
        so a request's output is the same whatever it is batched with (batch invariance).
    disable_split_kv : bool
        One item per query tile, whole KV.
    min_split_size, kv_align : int
        Lower bound on ``L_kv`` and the multiple it is rounded up to (a kernel's KV tile).
    busy_ctas : int, optional
        Balance over the first ``busy_ctas`` of the ``num_ctas`` CTAs only; the others get no item. A kernel
        whose launch is fixed at ``num_ctas`` CTAs (a captured CUDA graph records it) can so run a small batch on fewer,
        larger CTAs. Default: all ``num_ctas``.
    lead_items : bool
        With ``fixed_split_size``: a row's first item covers Algorithm 1's ``L_kv`` (with ``min_split_size`` and
        ``kv_align``) rounded up to a multiple of ``fixed_split_size``, the rest of a longer row one
        ``fixed_split_size`` chunk per item. For a kernel whose deterministic mode folds an item's chunks of the
        chunk grid itself, left to right (the torch tier's): the merge then folds the first item's state and the
        next chunks' in the order of the plan cut at every chunk-grid point, and only the cuts the batch needs
        write partial states.

    Returns
    -------
    WorkPlan
        The work items, their CTAs and the merge lists, as int32 arrays.

    Raises
    ------
    TypeError
        A length or an option that is not an integer (Python or NumPy; a float, even ``2.0``, or a bool).
    ValueError
        A negative length or one beyond int32, an option below 1 or beyond int32, ``num_ctas`` beyond
        ``MAX_CTAS``, ``busy_ctas`` beyond ``num_ctas``, ``lead_items`` without ``fixed_split_size``.

    Examples
    --------
    >>> import bsrattn as ba
    >>> p = ba.scheduler.plan([1, 1], [100, 10], num_ctas=4)
    >>> p.kv_chunk_size, p.num_items, p.num_merges
    (28, 5, 1)
    >>> ba.scheduler.plan([1, 1], [100, 10], num_ctas=4, busy_ctas=2).cta_indptr.tolist()
    [0, 1, 3, 3, 3]
    """
    qo, kv = _check_lengths(qo_lens, kv_lens)
    return _plan_valid(qo, kv, num_ctas=num_ctas, tile_q=tile_q, fixed_split_size=fixed_split_size,
                       disable_split_kv=disable_split_kv, min_split_size=min_split_size, kv_align=kv_align,
                       busy_ctas=busy_ctas, lead_items=lead_items)


def plan_layout(layout: BSRLayout, **options: Any) -> WorkPlan:
    """:func:`plan` of a layout's rows, whose lengths were checked when it was built: only ``options`` are checked.

    Parameters
    ----------
    layout : BSRLayout
        The rows to plan.
    **options : Any
        :func:`plan`'s keyword arguments (``num_ctas`` is required).
    Returns
    -------
    WorkPlan
        ``plan(layout.qo_lens, layout.kv_lens, **options)``.
    Examples
    --------
    >>> import bsrattn as ba
    >>> ba.scheduler.plan_layout(ba.layouts.ragged([1, 1], [100, 10]), num_ctas=4).num_items
    5
    """
    return _plan_valid(layout.qo_lens, layout.kv_lens, **options)


def _plan_valid(qo, kv, *, num_ctas: int, tile_q: int = 1, fixed_split_size: int | None = None,
                disable_split_kv: bool = False, min_split_size: int = 1, kv_align: int = 1,
                busy_ctas: int | None = None, lead_items: bool = False) -> WorkPlan:
    """:func:`plan` for lengths known to be valid (a :class:`~bsrattn.layout.BSRLayout`'s ``qo_lens`` and
    ``kv_lens``, int32 and checked when the layout was built): only the options are checked."""
    _check_options(num_ctas, tile_q, min_split_size, kv_align, fixed_split_size)
    if lead_items and fixed_split_size is None:
        raise ValueError("lead_items=True needs fixed_split_size: it rounds a row's first item onto that chunk grid")
    busy = num_ctas if busy_ctas is None else as_int("busy_ctas", busy_ctas, minimum=1, maximum=num_ctas)
    return _make_plan(qo, kv, busy, tile_q, _split(fixed_split_size, disable_split_kv), min_split_size, kv_align,
                      True, lead_items, all_ctas=num_ctas)


def round_robin(qo_lens: ArrayLike, kv_lens: ArrayLike, *, num_ctas: int, tile_q: int = 1) -> WorkPlan:
    """The baseline: every query tile is one item over its whole KV; item ``i`` goes to CTA ``i % num_ctas``.

    Parameters
    ----------
    qo_lens, kv_lens : ``[R]`` ints
        Query rows and KV slots of each block row, as in :func:`plan`.
    num_ctas : int
        CTAs, ``1..MAX_CTAS``.
    tile_q : int
        Query rows per tile.

    Returns
    -------
    WorkPlan
        No item is split, so there are no merges.

    Raises
    ------
    TypeError, ValueError
        As :func:`plan` raises them.

    Examples
    --------
    >>> import bsrattn as ba
    >>> rr = ba.scheduler.round_robin([1, 1, 1], [100, 10, 30], num_ctas=2)
    >>> rr.cta_loads().tolist()                # requests 0 and 2 on CTA 0, request 1 on CTA 1
    [132.0, 11.0]
    """
    qo, kv = _check_lengths(qo_lens, kv_lens)
    _check_options(num_ctas, tile_q)
    return _make_plan(qo, kv, num_ctas, tile_q, -1, 1, 1, False)


def simulate(distribution: str, batch: int, *, num_ctas: int = 132, trials: int = 50, seed: int = 0,
             **plan_kwargs: Any) -> SimulationResult:
    """Decode makespans of :func:`plan` against :func:`round_robin` on random batches (the seed's table).

    ``distribution`` names one of :data:`DISTRIBUTIONS`; ``plan_kwargs`` go to :func:`plan`. The study itself,
    :func:`bsrattn.makespan.compare`, is this with the two planners as arguments.

    Parameters
    ----------
    distribution : str
        A key of :data:`DISTRIBUTIONS`.
    batch : int
        Decode requests per trial.
    num_ctas : int
        CTAs of both planners (132: an H200's SMs).
    trials : int
        Random batches drawn.
    seed : int
        Seed of the one NumPy generator all trials draw from.
    **plan_kwargs : Any
        More keyword arguments of :func:`plan` (``tile_q``, ``fixed_split_size``…).

    Returns
    -------
    SimulationResult
        Round robin's makespan over Algorithm 1's, per trial.

    Raises
    ------
    ValueError
        An unknown ``distribution``.

    Examples
    --------
    >>> import bsrattn as ba
    >>> ba.scheduler.simulate("uniform kv=2048", 256, trials=2).median
    1.0
    """
    return compare(lambda qo, kv: round_robin(qo, kv, num_ctas=num_ctas),
                   lambda qo, kv: plan(qo, kv, num_ctas=num_ctas, **plan_kwargs), distribution, batch, trials=trials,
                   seed=seed)
