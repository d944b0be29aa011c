"""The block-sparse-row (BSR) layout: one description for every KV-cache layout.

A :class:`BSRLayout` is FlashInfer's plan input in BSR words. Row ``r`` is a block row (a request, or one
tile of queries); its columns are KV blocks of ``block_size`` slots taken from a pool of ``num_blocks``
blocks. Row ``r``'s logical KV sequence is its blocks in order, the last one cut to ``kv_last_len[r]``;
logical slot ``i`` of it lives at pool slot ``kv_indices[kv_indptr[r] + i // Bc] * Bc + i % Bc``.

Positions are logical: key ``i`` of a row is at position ``i`` and query ``i`` at
``kv_len - qo_len + i``, whatever pool slots they occupy. Position masks (causal, sliding window) and
ALiBi use these positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

from bsrattn import indexing
from bsrattn.coerce import INT32_MAX, as_index_array, as_int, indptr_of

if TYPE_CHECKING:
    from bsrattn.variant import Variant


def _as_int32_field(name, values):
    arr = as_index_array(name, values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    out = np.array(arr, dtype=np.int32, copy=True)
    out.flags.writeable = False
    return out


def _check_indptr(name, indptr, length=None):
    if indptr.size == 0 or indptr[0] != 0:
        raise ValueError(f"{name} must start at 0, got {indptr[:4].tolist()}")
    steps = np.diff(indptr)
    if (steps < 0).any():
        r = int(np.argmax(steps < 0))
        raise ValueError(f"{name} must be non-decreasing; {name}[{r}]={indptr[r]} > {name}[{r + 1}]={indptr[r + 1]}")
    if length is not None and indptr[-1] != length:
        raise ValueError(f"{name}[-1]={indptr[-1]} must equal {length}")


@dataclass(frozen=True, eq=False)
class BSRLayout:
    """A KV-cache layout as a block-sparse-row matrix (host int32 arrays, validated on construction).

    Parameters
    ----------
    qo_indptr : array of int, ``[R+1]``
        Query rows of row ``r`` are ``qo_indptr[r]:qo_indptr[r+1]``.
    kv_indptr : array of int, ``[R+1]``
        Row ``r`` owns ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]``.
    kv_indices : array of int, ``[nnz]``
        KV block (page) ids, each in ``[0, num_blocks)``.
    kv_last_len : array of int, ``[R]``
        Valid slots of row ``r``'s last block, ``1..block_size``; 0 for a row with no blocks.
    block_size : int
        Bc: 1 for ragged and vector-sparse layouts, the page size for a paged cache.
    num_blocks : int
        KV blocks in the pool.
    custom_mask : array of bool, optional
        Per-row ``[qo_len, kv_len]`` element masks, flattened row-major and concatenated over rows.

    Raises
    ------
    TypeError
        An index array holding anything but integers (floats are refused, even integral ones like ``2.0``,
        so a fractional or NaN id is never truncated), a ``block_size``/``num_blocks`` that is not an int, a
        ``custom_mask`` that is not bool.
    ValueError
        Entries outside int32, indptrs not starting at 0 or decreasing, ``kv_indices`` outside
        ``[0, num_blocks)``, ``kv_last_len`` outside ``1..block_size``, a row whose ``kv_len`` exceeds
        ``2**31 - 1`` (computed in int64, so it cannot wrap), a pool or a ``custom_mask`` too large for int32
        indexing, or a ``custom_mask`` of the wrong size.

    Examples
    --------
    >>> import bsrattn as ba
    >>> layout = ba.layouts.paged([1, 1], [[3, 0], [2]], kv_lens=[20, 5], page_size=16, num_pages=4)
    >>> layout.kv_lens.tolist(), layout.kv_slots(0)[14:18].tolist()
    ([20, 5], [62, 63, 0, 1])
    """

    qo_indptr: np.ndarray  # [R+1]
    kv_indptr: np.ndarray  # [R+1]
    kv_indices: np.ndarray  # [nnz]
    kv_last_len: np.ndarray  # [R]
    block_size: int
    num_blocks: int
    custom_mask: np.ndarray | None = None  # [sum_r qo_len[r] * kv_len[r]] bool
    _mask_indptr: np.ndarray = field(init=False, repr=False)
    # A plain int, so that code traced by torch.compile (run-time shape checks) sees a constant, not a
    # value read out of a NumPy array.
    _nnz_qo: int = field(init=False, repr=False)

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "block_size", as_int("block_size", self.block_size, minimum=1))
        set_(self, "num_blocks", as_int("num_blocks", self.num_blocks, minimum=0))
        if self.num_blocks * self.block_size > INT32_MAX:
            raise ValueError(f"num_blocks={self.num_blocks} x block_size={self.block_size} slots do not fit in int32 "
                             f"(at most {INT32_MAX})")
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_len"):
            set_(self, name, _as_int32_field(name, getattr(self, name)))
        if self.qo_indptr.size == 0:
            raise ValueError("qo_indptr is empty; it must be [R+1], starting at 0 (a layout of no rows is [0])")
        num_rows = self.qo_indptr.size - 1
        if self.kv_indptr.size != num_rows + 1:
            raise ValueError(f"kv_indptr has shape {self.kv_indptr.shape}, qo_indptr {self.qo_indptr.shape}: "
                             f"both must be [R+1]")
        if self.kv_last_len.size != num_rows:
            raise ValueError(f"kv_last_len has shape {self.kv_last_len.shape}, expected [R]=[{num_rows}]")
        _check_indptr("qo_indptr", self.qo_indptr)
        _check_indptr("kv_indptr", self.kv_indptr, self.kv_indices.size)
        if self.kv_indices.size:
            bad = (self.kv_indices < 0) | (self.kv_indices >= self.num_blocks)
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(f"kv_indices[{i}]={self.kv_indices[i]} is outside [0, num_blocks={self.num_blocks})")
        nblocks = np.diff(self.kv_indptr)
        has_blocks = nblocks > 0
        lo = np.where(has_blocks, 1, 0)
        hi = np.where(has_blocks, self.block_size, 0)
        bad = (self.kv_last_len < lo) | (self.kv_last_len > hi)
        if bad.any():
            r = int(np.argmax(bad))
            raise ValueError(f"kv_last_len[{r}]={self.kv_last_len[r]} must be in {lo[r]}..{hi[r]} "
                             f"(row {r} has {int(nblocks[r])} blocks of block_size={self.block_size})")
        # The lengths are derived once: a frozen layout is read on every plan() (host time, W6). In int64: a
        # row may list a block many times, and its length must not wrap before it is checked.
        qo_lens = np.diff(self.qo_indptr)
        kv_lens = np.where(has_blocks, (nblocks.astype(np.int64) - 1) * self.block_size + self.kv_last_len, 0)
        if kv_lens.size and kv_lens.max() > INT32_MAX:
            r = int(np.argmax(kv_lens > INT32_MAX))
            raise ValueError(f"row {r} has kv_len {kv_lens[r]} ({int(nblocks[r])} blocks of block_size="
                             f"{self.block_size}), more than int32 holds ({INT32_MAX})")
        kv_lens = kv_lens.astype(np.int32)
        for name, lens in (("_qo_lens", qo_lens), ("_kv_lens", kv_lens)):
            lens.flags.writeable = False
            set_(self, name, lens)
        mask_indptr = np.zeros(num_rows + 1, dtype=np.int64)
        np.cumsum(qo_lens.astype(np.int64) * kv_lens, out=mask_indptr[1:])
        mask_indptr.flags.writeable = False
        set_(self, "_mask_indptr", mask_indptr)
        set_(self, "_nnz_qo", int(self.qo_indptr[-1]))
        if self.custom_mask is not None:
            mask = np.asarray(self.custom_mask)
            if mask.dtype != bool:
                raise TypeError(f"custom_mask must be bool, got dtype {mask.dtype}")
            if mask.size != mask_indptr[-1]:
                raise ValueError(f"custom_mask has {mask.size} elements, expected sum(qo_len*kv_len)={mask_indptr[-1]}")
            if mask.size > INT32_MAX:
                raise ValueError(f"custom_mask has {mask.size} elements, more than int32 indexes ({INT32_MAX})")
            mask = np.array(mask.reshape(-1), copy=True)
            mask.flags.writeable = False
            set_(self, "custom_mask", mask)

    # ---- derived views -------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """R, the number of block rows."""
        return self.qo_indptr.size - 1

    @property
    def nnz_qo(self) -> int:
        """Query rows in total (the leading dimension of ``q``)."""
        return self._nnz_qo

    @property
    def num_slots(self) -> int:
        """KV slots in the pool, ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    @property
    def qo_lens(self) -> np.ndarray:
        """``[R]`` query rows per row (read-only)."""
        return self._qo_lens

    @property
    def kv_lens(self) -> np.ndarray:
        """``[R]`` KV slots per row: full blocks plus the last one cut to ``kv_last_len`` (read-only)."""
        return self._kv_lens

    @property
    def mask_indptr(self) -> np.ndarray:
        """``[R+1]`` offsets of each row's ``[qo_len, kv_len]`` block in ``custom_mask``."""
        return self._mask_indptr

    @property
    def query_positions(self) -> np.ndarray:
        """``[nnz_qo]`` int64: each query row's position among its row's keys, ``kv_len - qo_len + i`` (the
        position the position masks, ALiBi and fused RoPE give query ``i`` of a row)."""
        local = np.arange(self.nnz_qo, dtype=np.int64) - np.repeat(self.qo_indptr[:-1], self.qo_lens)
        return np.repeat(self.kv_lens - self.qo_lens, self.qo_lens) + local

    def kv_slots(self, r: int) -> np.ndarray:
        """Pool slots of row ``r``'s logical KV sequence, in order (``[kv_len[r]]``).

        Parameters
        ----------
        r : int
            The block row, in ``[0, R)``.

        Returns
        -------
        numpy.ndarray
            ``[kv_len[r]]`` int64 pool slots.

        Raises
        ------
        IndexError
            ``r`` outside ``[0, R)``.
        """
        if not 0 <= r < self.num_rows:
            raise IndexError(f"row {r} is outside [0, {self.num_rows})")
        i = np.arange(self.kv_lens[r], dtype=np.int64)
        return indexing.sparse_slot(self.kv_indices.astype(np.int64), int(self.kv_indptr[r]), self.block_size, i)

    def row_mask(self, r: int) -> np.ndarray | None:
        """Row ``r``'s ``[qo_len, kv_len]`` custom mask, or None when the layout has none.

        Parameters
        ----------
        r : int
            The block row, in ``[0, R)``.

        Returns
        -------
        numpy.ndarray or None
            ``[qo_len[r], kv_len[r]]`` bool, a read-only view of ``custom_mask``.
        """
        if self.custom_mask is None:
            return None
        lo, hi = self._mask_indptr[r], self._mask_indptr[r + 1]
        return self.custom_mask[lo:hi].reshape(int(self.qo_lens[r]), int(self.kv_lens[r]))

    def to_dense_mask(self, variant: Variant | None = None) -> np.ndarray:
        """``[nnz_qo, num_slots]`` bool: which pool slot each query row attends.

        Combines the block structure, ``kv_last_len``, the custom mask and, when a ``variant`` is given,
        its position masks (causal, sliding window). A row that lists a slot twice cannot be drawn as a
        mask and raises ``ValueError``.

        Parameters
        ----------
        variant : Variant, optional
            Whose position masks to apply; None masks no position.

        Returns
        -------
        numpy.ndarray
            ``[nnz_qo, num_slots]`` bool.

        Raises
        ------
        ValueError
            A row that lists a slot twice.

        Examples
        --------
        >>> import bsrattn as ba
        >>> lay = ba.layouts.paged([2], [[1]], kv_lens=[3], page_size=4, num_pages=2)
        >>> lay.to_dense_mask(ba.Variant(causal=True)).astype(int).tolist()
        [[0, 0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 1, 0]]
        """
        dense = np.zeros((self.nnz_qo, self.num_slots), dtype=bool)
        for r in range(self.num_rows):
            slots = self.kv_slots(r)
            if np.unique(slots).size != slots.size:
                raise ValueError(f"row {r} lists a KV slot more than once; a dense mask cannot represent that")
            qo_len, kv_len = int(self.qo_lens[r]), int(self.kv_lens[r])
            # No variant masks no position: the default Variant's mask, without importing variant (which imports
            # this module).
            visible = np.ones((qo_len, kv_len), bool) if variant is None else variant.position_mask(qo_len, kv_len)
            mask = self.row_mask(r)
            if mask is not None:
                visible = visible & mask
            dense[self.qo_indptr[r]:self.qo_indptr[r + 1], slots] = visible
        return dense

    def block_occupancy(self, block_rows: int = 1, block_cols: int | None = None) -> np.ndarray:
        """``[ceil(nnz_qo/Br), ceil(num_slots/Bc)]`` bool: the BSR picture, which tiles hold a visible pair.

        Parameters
        ----------
        block_rows : int
            Br, query rows per tile.
        block_cols : int, optional
            Bc, pool slots per tile; default ``block_size``.

        Returns
        -------
        numpy.ndarray
            ``[ceil(nnz_qo/Br), ceil(num_slots/Bc)]`` bool.

        Raises
        ------
        ValueError
            A row that lists a slot twice (as :meth:`to_dense_mask`).

        Examples
        --------
        >>> import bsrattn as ba
        >>> lay = ba.layouts.paged([1, 1], [[2], [0, 1]], kv_lens=[3, 6], page_size=4, num_pages=3)
        >>> lay.block_occupancy().astype(int).tolist()
        [[0, 0, 1], [1, 1, 0]]
        """
        block_cols = self.block_size if block_cols is None else block_cols
        dense = self.to_dense_mask()
        rows = indexing.ceil_div(dense.shape[0], block_rows)
        cols = indexing.ceil_div(dense.shape[1], block_cols)
        padded = np.zeros((rows * block_rows, cols * block_cols), dtype=bool)
        padded[:dense.shape[0], :dense.shape[1]] = dense
        return padded.reshape(rows, block_rows, cols, block_cols).any(axis=(1, 3))

    def read_amplification(self, kernel_block_size: int) -> "ReadAmplification":
        """KV slots a kernel with a fixed ``kernel_block_size`` reads to serve this layout.

        A kernel that loads aligned blocks of ``kernel_block_size`` pool slots must read every block that
        holds a needed slot. Needed slots are counted per row (a slot two rows use is needed twice).

        Parameters
        ----------
        kernel_block_size : int
            Pool slots per aligned block the kernel loads.

        Returns
        -------
        ReadAmplification

        Raises
        ------
        ValueError
            ``kernel_block_size < 1``.

        Examples
        --------
        >>> import numpy as np, bsrattn as ba
        >>> pages = np.arange(64) * 64          # 64 scattered pages of 16 slots
        >>> lay = ba.layouts.paged([1], [pages], kv_lens=[1024], page_size=16, num_pages=4096)
        >>> amp = lay.read_amplification(128)
        >>> amp.needed, amp.read, amp.ratio
        (1024, 8192, 8.0)
        """
        if kernel_block_size < 1:
            raise ValueError(f"kernel_block_size must be >= 1, got {kernel_block_size}")
        needed = read = 0
        for r in range(self.num_rows):
            slots = self.kv_slots(r)
            needed += slots.size
            read += np.unique(slots // kernel_block_size).size * kernel_block_size
        return ReadAmplification(kernel_block_size, int(needed), int(read))

    @classmethod
    def from_slots(cls, slots: Sequence[np.ndarray], qo_lens: ArrayLike, num_slots: int) -> BSRLayout:
        """The ``block_size=1`` layout whose row ``r`` has ``qo_lens[r]`` queries and reads pool slots
        ``slots[r]`` (a 1-D integer array) in order; checked only as every layout is, on construction.

        :func:`bsrattn.layouts.vector_sparse` is this with its arguments checked first.

        Parameters
        ----------
        slots : sequence of 1-D int arrays, ``[R][kv_len_r]``
            Each row's pool slots, in order.
        qo_lens : array_like of int, ``[R]``
            Query rows of each row.
        num_slots : int
            Slots in the pool (the layout's ``num_blocks``).

        Returns
        -------
        BSRLayout

        Raises
        ------
        TypeError, ValueError
            As :class:`BSRLayout` raises them.

        Examples
        --------
        >>> import numpy as np, bsrattn as ba
        >>> ba.BSRLayout.from_slots([np.array([9, 2, 5])], [1], num_slots=16).kv_slots(0).tolist()
        [9, 2, 5]
        """
        kv_lens = np.array([row.size for row in slots], dtype=np.int64)
        indices = np.concatenate(slots) if len(slots) else np.zeros(0, np.int64)
        return cls(indptr_of(qo_lens), indptr_of(kv_lens), indices, np.minimum(kv_lens, 1), 1, num_slots)

    def __repr__(self):
        return (f"BSRLayout(R={self.num_rows}, nnz_qo={self.nnz_qo}, nnz_blocks={self.kv_indices.size}, "
                f"block_size={self.block_size}, num_blocks={self.num_blocks}, "
                f"custom_mask={self.custom_mask is not None})")


@dataclass(frozen=True)
class ReadAmplification:
    """Slots needed against slots read by a kernel of block size ``kernel_block_size``.

    Returned by :meth:`BSRLayout.read_amplification`.

    Parameters
    ----------
    kernel_block_size : int
        Pool slots per aligned block the kernel loads.
    needed : int
        Slots the layout's rows read, counted per row.
    read : int
        Slots in the aligned blocks that hold a needed slot, counted per row.

    Examples
    --------
    >>> import bsrattn as ba
    >>> amp = ba.ReadAmplification(kernel_block_size=128, needed=1024, read=8192)
    >>> amp.ratio
    8.0
    """

    kernel_block_size: int
    needed: int
    read: int

    @property
    def ratio(self) -> float:
        """``read / needed`` (1.0 when nothing is needed)."""
        return self.read / self.needed if self.needed else 1.0
