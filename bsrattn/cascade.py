"""A Cascade: levels of one attention whose states merge with ⊕ (composable formats, a shared prefix)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from bsrattn.coerce import INT32_MAX, as_int
from bsrattn.layout import BSRLayout

if TYPE_CHECKING:
    from bsrattn.variant import Variant


@dataclass(frozen=True, eq=False)
class Cascade:
    """Levels of one attention whose states merge with ⊕ (composable formats).

    Every level has the same query rows (``nnz_qo``) and reads the same KV pool; level ``l`` covers a
    disjoint part of each query's keys. The attention over the cascade is the ⊕-fold of the levels' states
    in level order. Levels before the last precede every query (a shared prefix), so position masks apply
    only within the last level. Fused RoPE turns queries and keys at their positions in the whole sequence
    (:meth:`rope_positions`); ALiBi and sliding windows, which would mask or bias the earlier levels per query,
    are rejected.

    Parameters
    ----------
    levels : sequence of BSRLayout
        The levels, in merge order; all over the same queries and the same KV pool.

    Examples
    --------
    >>> import bsrattn as ba
    >>> prefix = ba.layouts.paged([2], [[0]], kv_lens=[4], page_size=4, num_pages=3)      # both queries, one row
    >>> suffix = ba.layouts.paged([1, 1], [[1], [2]], kv_lens=[2, 3], page_size=4, num_pages=3)
    >>> cascade = ba.Cascade((prefix, suffix))
    >>> cascade.nnz_qo, cascade.flatten().kv_lens.tolist()
    (2, [6, 7])
    """

    levels: tuple

    def __post_init__(self):
        levels = tuple(self.levels)
        if not levels:
            raise ValueError("a Cascade needs at least one level")
        for i, level in enumerate(levels):
            if not isinstance(level, BSRLayout):
                raise TypeError(f"levels[{i}] must be a BSRLayout, got {type(level).__name__}")
            if level.nnz_qo != levels[0].nnz_qo:
                raise ValueError(f"levels[{i}] has nnz_qo={level.nnz_qo}, levels[0] has {levels[0].nnz_qo}")
            if level.num_slots != levels[0].num_slots:
                raise ValueError(f"levels[{i}] addresses {level.num_slots} pool slots, "
                                 f"levels[0] {levels[0].num_slots}: "
                                 f"levels must share one KV pool")
            if level.custom_mask is not None:
                raise ValueError(f"levels[{i}] has a custom_mask; cascade levels take position masks only")
        object.__setattr__(self, "levels", levels)

    @property
    def nnz_qo(self) -> int:
        """Query rows, the same in every level."""
        return self.levels[0].nnz_qo

    @property
    def num_slots(self) -> int:
        """KV slots of the pool the levels share."""
        return self.levels[0].num_slots

    def level_variant(self, level: int, variant: Variant) -> Variant:
        """The variant level ``level`` runs with: levels before the last see all their keys.

        Parameters
        ----------
        level : int
            The level's index in ``levels``.
        variant : Variant
            The cascade's variant.

        Returns
        -------
        Variant
            ``variant`` for the last level; for the others, ``variant`` without its causal mask.

        Raises
        ------
        ValueError
            ``variant`` has ALiBi slopes or a sliding window; ``variant`` is causal and a last-level row has
            more than one query beyond its keys (see :meth:`flatten`).
        """
        if variant.alibi_slopes is not None or variant.window_left >= 0:
            raise ValueError("Cascade does not support alibi_slopes or window_left: they would bias or mask the "
                             "earlier levels' keys per query; use the flattened layout (Cascade.flatten())")
        if variant.causal:
            self._check_causal_rows()
        return variant if level == len(self.levels) - 1 else replace(variant, causal=False)

    def _check_causal_rows(self) -> None:
        """Refuse a last-level row with more than one query beyond its keys: under a causal mask its first queries
        would see none of its keys yet every earlier-level key, an attention that no one causal row over a
        query's keys in order (:meth:`flatten`, deterministic mode) computes: there they would sit inside the
        earlier levels and lose the keys after them."""
        last = self.levels[-1]
        over = np.flatnonzero(last.qo_lens > last.kv_lens + 1)
        if over.size:
            r = int(over[0])
            raise ValueError(f"layout: the Cascade's last level row {r} has {int(last.qo_lens[r])} queries and "
                             f"{int(last.kv_lens[r])} keys; under causal=True a last-level row may hold at most one "
                             f"query more than its keys (its first queries would see every earlier-level key and "
                             f"none of its own, which its flattened causal row cannot express)")

    def rope_positions(self, level: int) -> tuple[np.ndarray, np.ndarray]:
        """Where fused RoPE turns level ``level``'s queries and keys: at their positions in the whole sequence.

        A query's keys are its rows' keys of every level in level order, as in :meth:`flatten`: its position is
        ``K - qo_len + i`` for ``K`` its keys in all levels and ``i`` its place among the ``qo_len`` queries of its
        last-level row, and slot ``j`` of a level's row sits at ``j`` plus the keys of the earlier levels.

        Parameters
        ----------
        level : int
            The level's index in ``levels``.

        Returns
        -------
        q_positions : numpy.ndarray
            ``[nnz_qo]`` int64, each query's position.
        kv_offsets : numpy.ndarray
            ``[R]`` int64 for the level's ``R`` rows: the position of each row's first slot.

        Raises
        ------
        ValueError
            A level's row whose queries have different numbers of earlier-level keys (its slots would sit at
            a different position for each), or positions past int32.

        Examples
        --------
        >>> import bsrattn as ba
        >>> c = ba.layouts.shared_prefix([1, 2], [0], 4, [[1], [2]], [3, 5], page_size=8, num_pages=3)
        >>> [p.tolist() for p in c.rope_positions(0)], [p.tolist() for p in c.rope_positions(1)]
        ([[6, 7, 8], [0]], [[6, 7, 8], [4, 4]])
        """
        level = as_int("level", level, minimum=0, maximum=len(self.levels) - 1)

        def keys_before(upto):  # [nnz_qo]: each query's keys in the levels before level ``upto``
            zero = np.zeros(self.nnz_qo, np.int64)
            return sum((np.repeat(lv.kv_lens, lv.qo_lens) for lv in self.levels[:upto]), zero)

        q_positions = keys_before(len(self.levels) - 1) + self.levels[-1].query_positions
        if q_positions.size and int(q_positions.max()) > INT32_MAX:
            raise ValueError(f"a query sits at position {int(q_positions.max())}, past int32 (the GPU kernels' index)")
        lay, before = self.levels[level], keys_before(level)
        kv_offsets = np.zeros(lay.num_rows, dtype=np.int64)
        for r in np.flatnonzero(lay.qo_lens):
            seen = before[lay.qo_indptr[r]:lay.qo_indptr[r + 1]]
            if np.any(seen != seen[0]):
                raise ValueError(f"levels[{level}] row {r} holds queries with {int(seen.min())} and {int(seen.max())} "
                                 f"keys in the levels before it: fused RoPE needs one position per slot")
            kv_offsets[r] = seen[0]
        return q_positions, kv_offsets

    def flatten(self, causal: bool = False) -> BSRLayout:
        """The same attention as one ``block_size=1`` layout: each query's slots from every level in order.

        Requires each level's rows to cover contiguous runs of queries so that a query's row in every level
        is well defined; the flattened layout has one row per query row of the last level's rows. Under a causal
        mask it is the same attention when each last-level row has at most one query more than its keys (a
        causal row places its queries at its last keys: more queries than that would put the first of them
        inside the earlier levels); ``causal=True`` refuses any other row, as the Cascade's causal calls do.

        Parameters
        ----------
        causal : bool
            Whether the flattened layout will run under a causal variant: rows it cannot express are refused.

        Returns
        -------
        BSRLayout
            ``block_size=1``, over the same pool.

        Raises
        ------
        ValueError
            Queries of one last-level row that see different earlier-level keys; with ``causal``, a last-level
            row with more than one query beyond its keys.
        """
        if causal:
            self._check_causal_rows()
        last = self.levels[-1]
        slots_per_query = [[] for _ in range(self.nnz_qo)]
        for level in self.levels:
            for r in range(level.num_rows):
                slots = level.kv_slots(r)
                for qi in range(level.qo_indptr[r], level.qo_indptr[r + 1]):
                    slots_per_query[qi].append(slots)
        rows_qo, rows_kv = [], []
        for r in range(last.num_rows):
            lo, hi = int(last.qo_indptr[r]), int(last.qo_indptr[r + 1])
            prefixes = [np.concatenate(slots_per_query[qi][:-1]) if len(slots_per_query[qi]) > 1
                        else np.zeros(0, np.int64) for qi in range(lo, hi)]
            if any(not np.array_equal(p, prefixes[0]) for p in prefixes[1:]):
                raise ValueError(f"queries of last-level row {r} see different earlier-level keys")
            rows_qo.append(hi - lo)
            rows_kv.append(np.concatenate([prefixes[0], last.kv_slots(r)]) if prefixes else last.kv_slots(r))
        return BSRLayout.from_slots(rows_kv, rows_qo, self.num_slots)
