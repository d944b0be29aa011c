"""The plan half of plan/run: FlashInfer's load-balancing scheduler (Algorithm 1), on the host.

``plan`` splits each query tile's KV into chunks, sorts the resulting work items longest first and gives
each to the least-loaded CTA (a min-heap). A tile split into several chunks writes one partial attention
state per chunk into a workspace slot, and a merge list folds them afterwards **in chunk order**, never in
completion order, so the result is deterministic. Everything is a pure function of the lengths.

A :class:`WorkPlan` is plain int32 arrays a kernel can read. The grid it describes is ``num_ctas`` CTAs
per KV head (a kernel launches ``num_ctas x num_kv_heads`` programs); CTA ``c`` runs items
``cta_indptr[c]:cta_indptr[c+1]`` in order.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, fields

import numpy as np

from bsrattn import indexing

__all__ = ["WorkPlan", "plan", "round_robin", "makespan", "simulate", "SimulationResult", "DISTRIBUTIONS"]


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
    merge_indptr : ``[M+1]``; merge_partials : ``[P]``; merge_qo_start, merge_qo_end : ``[M]``
        Merge ``m`` folds, for each query row ``merge_qo_start[m] + i``, the partial rows
        ``merge_partials[merge_indptr[m]:merge_indptr[m+1]] + i`` in that order, into the output.
    num_partial_rows : int
        Workspace rows the partial states need.
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
        return int(self.item_row.size)

    @property
    def num_merges(self) -> int:
        return int(self.merge_qo_start.size)

    def cta_loads(self, cost=None) -> np.ndarray:
        """``[num_ctas]`` summed cost per CTA (``cost`` defaults to ``item_cost``)."""
        cost = self.item_cost if cost is None else np.asarray(cost)
        owner = np.repeat(np.arange(self.num_ctas), np.diff(self.cta_indptr))
        return np.bincount(owner, weights=cost, minlength=self.num_ctas)

    def equals(self, other: "WorkPlan") -> bool:
        """Bitwise equality of every field."""
        return all(np.array_equal(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))


def _check_lengths(qo_lens, kv_lens):
    qo = np.asarray(qo_lens)
    kv = np.asarray(kv_lens)
    for name, arr in (("qo_lens", qo), ("kv_lens", kv)):
        if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(f"{name} must be a 1-D sequence of ints, got {arr.dtype} of shape {arr.shape}")
        if (arr < 0).any():
            raise ValueError(f"{name} must be >= 0, got {arr.tolist()[:8]}")
    if qo.shape != kv.shape:
        raise ValueError(f"qo_lens {qo.shape} and kv_lens {kv.shape} must have the same shape")
    return qo.astype(np.int64), kv.astype(np.int64)


def _check_positive(**values):
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _tiles(qo_lens, kv_lens, tile_q):
    """Query tiles: ``(row, qo_start, qo_end, kv_len)`` per tile, rows in order."""
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)])
    n_tiles = indexing.ceil_div(qo_lens, tile_q)
    row = np.repeat(np.arange(qo_lens.size), n_tiles)
    first = np.repeat(np.cumsum(n_tiles) - n_tiles, n_tiles)
    start = qo_indptr[row] + (np.arange(row.size) - first) * tile_q
    end = np.minimum(start + tile_q, qo_indptr[row + 1])
    return row, start, end, kv_lens[row]


def chunk_size(qo_lens, kv_lens, *, num_ctas, tile_q=1, fixed_split_size=None, disable_split_kv=False,
               min_split_size=1, kv_align=1) -> int:
    """Algorithm 1's ``L_kv = ceil(sum ceil(l_qo/T_q) * l_kv / num_ctas)``, bounded below and aligned; 0 = no split."""
    qo, kv = _check_lengths(qo_lens, kv_lens)
    _check_positive(num_ctas=num_ctas, tile_q=tile_q, min_split_size=min_split_size, kv_align=kv_align)
    if disable_split_kv:
        return 0
    if fixed_split_size is not None:
        _check_positive(fixed_split_size=fixed_split_size)
        return int(fixed_split_size)
    total = int((indexing.ceil_div(qo, tile_q) * kv).sum())
    size = max(indexing.ceil_div(total, num_ctas), min_split_size, 1)
    return int(indexing.ceil_div(size, kv_align) * kv_align)


def _build(num_ctas, tile_q, chunk, row, qo_start, qo_end, kv_start, kv_end, tile_id, n_chunks, owner):
    """Assemble a WorkPlan from items (in tile order) and their CTA owners, keeping each CTA's order."""
    q_rows = qo_end - qo_start
    split = n_chunks[tile_id] > 1
    partial = np.full(row.size, -1, dtype=np.int64)
    partial[split] = np.concatenate([[0], np.cumsum(q_rows[split])[:-1]]) if split.any() else []
    num_partial_rows = int(q_rows[split].sum())
    merge_items = np.flatnonzero(split)
    first_of_tile = np.ones(merge_items.size, dtype=bool)
    first_of_tile[1:] = tile_id[merge_items][1:] != tile_id[merge_items][:-1]
    heads = merge_items[first_of_tile]
    merge_indptr = np.concatenate([np.flatnonzero(first_of_tile), [merge_items.size]])
    order = owner[1]
    cta_indptr = np.zeros(num_ctas + 1, dtype=np.int64)
    np.cumsum(np.bincount(owner[0], minlength=num_ctas), out=cta_indptr[1:])
    i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)  # noqa: E731
    return WorkPlan(
        num_ctas=int(num_ctas), tile_q=int(tile_q), kv_chunk_size=int(chunk), cta_indptr=i32(cta_indptr),
        item_row=i32(row[order]), item_qo_start=i32(qo_start[order]), item_qo_end=i32(qo_end[order]),
        item_kv_start=i32(kv_start[order]), item_kv_end=i32(kv_end[order]), item_partial=i32(partial[order]),
        item_cost=i32((q_rows + kv_end - kv_start)[order]), merge_indptr=i32(merge_indptr),
        merge_partials=i32(partial[merge_items]), merge_qo_start=i32(qo_start[heads]),
        merge_qo_end=i32(qo_end[heads]), num_partial_rows=num_partial_rows)


def plan(qo_lens, kv_lens, *, num_ctas: int, tile_q: int = 1, fixed_split_size: int | None = None,
         disable_split_kv: bool = False, min_split_size: int = 1, kv_align: int = 1) -> WorkPlan:
    """FlashInfer's Algorithm 1: KV chunking, longest-first, least-loaded CTA, fixed merge order.

    Parameters
    ----------
    qo_lens, kv_lens : ``[R]`` ints
        Query rows and KV slots of each block row.
    num_ctas : int
        CTAs to balance over (per KV head).
    tile_q : int
        Query rows per tile, ``T_q``.
    fixed_split_size : int, optional
        Chunk size to use instead of ``L_kv``: chunk boundaries then depend on a row's own length only,
        so a request's output is the same whatever it is batched with (batch invariance).
    disable_split_kv : bool
        One item per query tile, whole KV.
    min_split_size, kv_align : int
        Lower bound on ``L_kv`` and the multiple it is rounded up to (a kernel's KV tile).

    Returns
    -------
    WorkPlan

    Examples
    --------
    >>> import bsrattn as ba
    >>> p = ba.scheduler.plan([1, 1], [100, 10], num_ctas=4)
    >>> p.kv_chunk_size, p.num_items, p.num_merges
    (28, 5, 1)
    """
    qo, kv = _check_lengths(qo_lens, kv_lens)
    chunk = chunk_size(qo, kv, num_ctas=num_ctas, tile_q=tile_q, fixed_split_size=fixed_split_size,
                       disable_split_kv=disable_split_kv, min_split_size=min_split_size, kv_align=kv_align)
    t_row, t_qs, t_qe, t_kv = _tiles(qo, kv, tile_q)
    n_chunks = np.maximum(indexing.ceil_div(t_kv, chunk), 1) if chunk else np.ones_like(t_kv)
    tile_id = np.repeat(np.arange(t_row.size), n_chunks)
    local = np.arange(tile_id.size) - np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
    kv_start = local * chunk if chunk else np.zeros_like(tile_id)
    kv_end = np.minimum(kv_start + chunk, t_kv[tile_id]) if chunk else t_kv[tile_id]
    cost = (t_qe - t_qs)[tile_id] + kv_end - kv_start
    # Longest first; equal costs keep item order, so the plan is a pure function of the lengths.
    by_cost = np.lexsort((np.arange(cost.size), -cost))
    heap = [(0, c) for c in range(num_ctas)]
    owner_of = np.empty(cost.size, dtype=np.int64)
    for w in by_cost:
        load, c = heapq.heappop(heap)
        owner_of[w] = c
        heapq.heappush(heap, (load + int(cost[w]), c))
    # Within a CTA, items run in the order they were assigned (longest first).
    assigned_rank = np.empty(cost.size, dtype=np.int64)
    assigned_rank[by_cost] = np.arange(cost.size)
    order = np.lexsort((assigned_rank, owner_of))
    return _build(num_ctas, tile_q, chunk, t_row[tile_id], t_qs[tile_id], t_qe[tile_id], kv_start, kv_end,
                  tile_id, n_chunks, (owner_of, order))


def round_robin(qo_lens, kv_lens, *, num_ctas: int, tile_q: int = 1) -> WorkPlan:
    """The baseline: every query tile is one item over its whole KV; item ``i`` goes to CTA ``i % num_ctas``."""
    qo, kv = _check_lengths(qo_lens, kv_lens)
    _check_positive(num_ctas=num_ctas, tile_q=tile_q)
    t_row, t_qs, t_qe, t_kv = _tiles(qo, kv, tile_q)
    tile_id = np.arange(t_row.size)
    owner_of = tile_id % num_ctas
    order = np.lexsort((tile_id, owner_of))
    return _build(num_ctas, tile_q, 0, t_row, t_qs, t_qe, np.zeros_like(t_kv), t_kv, tile_id,
                  np.ones_like(t_kv), (owner_of, order))


def makespan(work_plan: WorkPlan, cost=None) -> float:
    """The most loaded CTA's total cost: the plan's finishing time under the cost model."""
    loads = work_plan.cta_loads(cost)
    return float(loads.max()) if loads.size else 0.0


def _uniform(lo, hi):
    return lambda rng, n: rng.integers(lo, hi + 1, size=n)


DISTRIBUTIONS = {
    "uniform kv=2048": lambda rng, n: np.full(n, 2048),
    "U(512, 2048)": _uniform(512, 2048),
    "U(4096, 16384)": _uniform(4096, 16384),
    "lognormal": lambda rng, n: np.clip(rng.lognormal(mean=6.5, sigma=0.75, size=n), 16, 131072).astype(np.int64),
}
"""Decode KV-length distributions of the seed's makespan table (the lognormal is ShareGPT-like)."""


@dataclass(frozen=True)
class SimulationResult:
    """Round-robin makespan over planned makespan, per trial."""

    distribution: str
    batch: int
    ratios: np.ndarray

    @property
    def median(self) -> float:
        return float(np.median(self.ratios))

    @property
    def min(self) -> float:
        return float(self.ratios.min())

    @property
    def max(self) -> float:
        return float(self.ratios.max())


def simulate(distribution: str, batch: int, *, num_ctas: int = 132, trials: int = 50, seed: int = 0,
             **plan_kwargs) -> SimulationResult:
    """Decode makespans of :func:`plan` against :func:`round_robin` on random batches (the seed's table).

    >>> import bsrattn as ba
    >>> ba.scheduler.simulate("uniform kv=2048", 256, trials=2).median
    1.0
    """
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {distribution!r}; choose from {sorted(DISTRIBUTIONS)}")
    rng = np.random.default_rng(seed)
    ratios = []
    for _ in range(trials):
        kv = DISTRIBUTIONS[distribution](rng, batch)
        qo = np.ones_like(kv)
        rr = makespan(round_robin(qo, kv, num_ctas=num_ctas))
        ratios.append(rr / makespan(plan(qo, kv, num_ctas=num_ctas, **plan_kwargs)))
    return SimulationResult(distribution, batch, np.array(ratios))
