"""Context-parallel attention over ``torch.distributed``: every rank holds a shard of each request's KV.

The queries are replicated; the keys are not. Rank ``r`` holds, for every request, some of its keys in a KV
pool of its own, described by a :class:`Shard`: a :class:`~bsrattn.BSRLayout` over that pool (row ``b`` is
request ``b``) and each local key's global position in its request. Attention over all of a request's keys
is the ⊕ of the ranks' partial states (see :mod:`bsrattn.reference.merge`), so each rank

1. computes its states ``(o, lse)`` over its own keys with the ordinary plan/run of its tier,
2. all-gathers them (``o`` and ``lse`` only, as one byte buffer, after a one-word status from each rank),
3. folds them in rank order, ``((s_0 ⊕ s_1) ⊕ s_2) ⊕ …``, with the tier's
   :func:`~bsrattn.merge_states`,

and every rank returns the same ``out``/``lse``, bit for bit.

**What is bitwise and what is not.** The result equals, bit for bit, what one process computes from the
same shards' states with the same tier, folded in the same order. Against unsharded attention it agrees to
rounding (:mod:`bsrattn.testing`'s tolerances): a different cut of the keys is a different fold. Bitwise
equality with unsharded attention needs a deterministic chunk grid at absolute positions that every shard
boundary falls on, each chunk computed with one fixed tile configuration; this module does not provide
that grid.

**Sharding.** :func:`shards` and :func:`shard` cut one global ragged batch (``qo_lens``, ``kv_lens``) in
``"contiguous"`` ranges (rank ``r`` holds positions ``[r*L//W, (r+1)*L//W)`` of a request of ``L`` keys) or
``"interleaved"`` tokens (position ``p`` lives on rank ``p % W``). Any other layout works too: build a
:class:`Shard` from a local layout (paged, say) and the positions of its keys.

**Variants.** Scores, the soft cap, ``sm_scale`` and FlashSigmoid (whose states add, in rank order) do not
depend on positions and are supported for every query. Causal masking and sliding windows depend on each
key's global position, which a shard's logical order does not give (an interleaved shard's keys are ``W``
apart): the plan turns them into the local layout's custom mask over global positions
(:meth:`Shard.attention_layout`), a ``[qo_len, local kv_len]`` bool array per request. A causal decode step
(one query, which sees every key) needs no mask and gets none; a prefill's mask costs ``qo_len x kv_len / W``
bytes per request, fine for chunked prefill, too much for a whole long prompt at once. Fused RoPE turns the
queries and keys at their global positions (:meth:`Shard.rope_positions`), which needs each request's keys on a
rank to be consecutive positions (``"contiguous"`` sharding); an interleaved shard is refused with a
``ValueError``. ALiBi (``alibi_slopes``) is refused too: its bias is a function of positions that a mask cannot
carry.

**Errors on every rank.** Before any state is exchanged the ranks all-gather a small summary and compare
it, so that bad input raises the same error on every rank instead of leaving some rank waiting in a
collective: ranks that disagree on the plan (the batch's lengths, heads, ``head_dim``, dtypes, variant,
tier), shards whose positions overlap or leave a gap (per request, the key counts and a 64-bit hash sum of
the positions, then the positions themselves to name the culprits), a shard made for another rank or world
size, and any rank whose own checks fail (a ``q`` of another shape, say). The error names the rank and what
disagrees. The collectives run under the process group's timeout (``init_process_group(timeout=...)``),
which bounds the wait for a rank that never arrives; a rank that dies closes its connections and the others
fail at once.

**Devices.** The code is device-agnostic: states travel on the group's device, the current CUDA device for
a group whose backend is NCCL and the CPU for any other (gloo, or a mixed ``cpu:gloo,cuda:nccl`` group, so
that every rank's tensors meet in one backend); NumPy states go through CPU tensors. With NCCL, call
``torch.cuda.set_device`` for the rank's GPU first (the summaries use ``all_gather_object``). It is tested
on CPU with gloo only. It sets no NCCL variable and never enables NVLink multicast.

Examples
--------
>>> from bsrattn import distributed
>>> parts = distributed.shards([1, 1], [5, 3], world_size=2, sharding="interleaved")
>>> [p.positions.tolist() for p in parts], parts[1].layout.kv_lens.tolist()
([[0, 2, 4, 0, 2], [1, 3, 1]], [2, 1])
>>> parts[1].global_slots.tolist()      # rows of the global ragged [sum(kv_lens), Hkv, D] KV buffer
[1, 3, 6]
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

try:
    import torch
    import torch.distributed as dist
except ImportError as err:
    raise ImportError("bsrattn.distributed needs torch: pip install 'bsrattn[torch]'") from err

from bsrattn import indexing, layouts
from bsrattn.api import BatchAttention
from bsrattn.state import merge_states
from bsrattn.coerce import as_index_array, as_int
from bsrattn.layout import BSRLayout
from bsrattn.state import merge_sinks
from bsrattn.validation import FLOAT_DTYPES, dtype_name, shape_of
from bsrattn.variant import Variant

__all__ = ["SHARDINGS", "Shard", "shard", "shards", "ContextParallelAttention", "context_parallel_attention"]

SHARDINGS = ("contiguous", "interleaved")

# torch 2.13 deprecates all_gather_into_tensor for all_gather_single; torch 2.5 to 2.12 have only the former.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True, eq=False)
class Shard:
    """One rank's keys of every request: a layout over the rank's own KV pool and the keys' global positions.

    Parameters
    ----------
    layout : BSRLayout
        This rank's keys; row ``b`` is request ``b`` (its queries are the whole batch's ``q`` rows of request
        ``b``), and its logical keys are this rank's keys of request ``b`` in any order.
    positions : array of int, ``[sum(layout.kv_lens)]``
        Global position, in its request, of each of the layout's logical keys, row after row: key ``j`` of
        row ``b`` is ``positions[key_indptr[b] + j]``.
    kv_lens : array of int, ``[R]``
        Keys of each request over all ranks: a query's position is ``kv_lens[b] - qo_len + i``.
    rank, world_size : int
        The rank this shard belongs to, of how many.

    Notes
    -----
    Only shapes are checked here; whether the positions of all ranks cover each request's keys exactly
    once is checked, on every rank at once, by :meth:`ContextParallelAttention.plan`.

    Examples
    --------
    >>> import bsrattn as ba
    >>> from bsrattn import distributed
    >>> pages = ba.layouts.paged([1], [[2, 0]], kv_lens=[5], page_size=4, num_pages=3)   # keys 5..9 of 10
    >>> part = distributed.Shard(pages, positions=[5, 6, 7, 8, 9], kv_lens=[10], rank=1, world_size=2)
    >>> part.row_positions(0).tolist(), part.attention_layout(ba.Variant(causal=True))[0].custom_mask is None
    ([5, 6, 7, 8, 9], True)
    """

    layout: BSRLayout
    positions: np.ndarray  # [sum(layout.kv_lens)] int64
    kv_lens: np.ndarray  # [R] int64
    rank: int
    world_size: int
    key_indptr: np.ndarray = field(init=False, repr=False)  # [R+1] int64

    def __post_init__(self):
        set_ = object.__setattr__
        if not isinstance(self.layout, BSRLayout):
            raise TypeError(f"layout must be a BSRLayout, got {type(self.layout).__name__}")
        set_(self, "world_size", as_int("world_size", self.world_size, minimum=1))
        set_(self, "rank", as_int("rank", self.rank, minimum=0, maximum=self.world_size - 1))
        for name in ("positions", "kv_lens"):
            arr = as_index_array(name, getattr(self, name))
            if arr.ndim != 1:
                raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
            arr = arr.astype(np.int64)
            arr.flags.writeable = False
            set_(self, name, arr)
        if self.kv_lens.size != self.layout.num_rows:
            raise ValueError(f"kv_lens has {self.kv_lens.size} entries, the layout has R={self.layout.num_rows} rows")
        key_indptr = np.zeros(self.layout.num_rows + 1, dtype=np.int64)
        np.cumsum(self.layout.kv_lens, out=key_indptr[1:])
        key_indptr.flags.writeable = False
        set_(self, "key_indptr", key_indptr)
        if self.positions.size != key_indptr[-1]:
            raise ValueError(f"positions has {self.positions.size} entries, the layout has sum(kv_lens)="
                             f"{key_indptr[-1]} keys")

    @property
    def global_slots(self) -> np.ndarray:
        """``[sum(layout.kv_lens)]``: each local key's row in the global ragged KV buffer
        (``ba.layouts.ragged(qo_lens, kv_lens)``): for a shard made by :func:`shard`, ``k_local =
        k_global[shard.global_slots]``."""
        offsets = np.zeros(self.kv_lens.size + 1, dtype=np.int64)
        np.cumsum(self.kv_lens, out=offsets[1:])
        request = np.repeat(np.arange(self.kv_lens.size), np.diff(self.key_indptr))
        return offsets[request] + self.positions

    def row_positions(self, b: int) -> np.ndarray:
        """Global positions of request ``b``'s keys on this rank, in the layout's logical order."""
        return self.positions[self.key_indptr[b]:self.key_indptr[b + 1]]

    def rope_positions(self) -> tuple[np.ndarray, np.ndarray]:
        """Where fused RoPE turns this rank's queries and keys: at their global positions.

        Returns
        -------
        q_positions : numpy.ndarray
            ``[nnz_qo]`` int64: query ``i`` of request ``b`` at ``kv_lens[b] - qo_len + i`` (global ``kv_lens``).
        kv_offsets : numpy.ndarray
            ``[R]`` int64: the global position of each request's first key on this rank (0 for none).

        Raises
        ------
        ValueError
            A request whose keys on this rank are not consecutive positions (an interleaved shard's are
            ``world_size`` apart): fused RoPE turns a row's slot ``j`` at one offset plus ``j``.

        Examples
        --------
        >>> from bsrattn import distributed
        >>> [p.tolist() for p in distributed.shard([1, 2], [5, 6], rank=1, world_size=2).rope_positions()]
        [[4, 4, 5], [2, 3]]
        """
        lay = self.layout
        offsets = np.zeros(lay.num_rows, dtype=np.int64)
        for b in range(lay.num_rows):
            pos = self.row_positions(b)
            if pos.size and not np.array_equal(pos, pos[0] + np.arange(pos.size)):
                at = int(np.argmax(pos != pos[0] + np.arange(pos.size)))
                raise ValueError(f"fused RoPE (variant.rope_theta) turns a row's slot j at one offset plus j, but "
                                 f"request {b}'s keys on this rank are not consecutive positions (slot {at} holds "
                                 f"position {int(pos[at])} after {int(pos[at - 1])}); shard with "
                                 f"sharding='contiguous', or rotate the keys before caching them")
            offsets[b] = pos[0] if pos.size else 0
        # The layout's own query positions count this rank's keys; the request's count all of them.
        return lay.query_positions + np.repeat(self.kv_lens - lay.kv_lens, lay.qo_lens), offsets

    def attention_layout(self, variant=None) -> tuple:
        """``(layout, variant)`` this rank's tier runs: causal and window masks over global positions.

        The variant comes back without its ``sinks``: they are merged once into the ranks' merged state, not by
        every rank's attention. A variant without ``causal`` or ``window_left`` otherwise comes back as it is,
        with :attr:`layout`. Otherwise
        the masks become the layout's custom mask (combined with one the layout has), computed from
        :attr:`positions` and :attr:`kv_lens`, and the variant loses ``causal`` and ``window_left``; a mask
        that hides nothing (a decode step) is left out.

        Raises
        ------
        ValueError
            ``variant.alibi_slopes`` is set: ALiBi's bias depends on positions and is not supported here.
        """
        variant = Variant() if variant is None else variant
        if variant.alibi_slopes is not None:
            raise ValueError("variant.alibi_slopes is set: ALiBi adds slope * (k_pos - q_pos) to the scores, a "
                             "function of global positions that a shard's layout cannot carry; bsrattn.distributed "
                             "does not support it")
        variant = replace(variant, sinks=None)  # merged once, after the ranks' states (ContextParallelAttention.run)
        if not variant.causal and variant.window_left < 0:
            return self.layout, variant
        lay = self.layout
        masks = []
        for b in range(lay.num_rows):
            qo_len = int(lay.qo_lens[b])
            q_pos = indexing.query_position(qo_len, int(self.kv_lens[b]), np.arange(qo_len))[:, None]
            visible = indexing.key_visible(q_pos, self.row_positions(b)[None, :], variant.causal, variant.window_left)
            own = lay.row_mask(b)
            masks.append((visible if own is None else visible & own).reshape(-1))
        mask = np.concatenate(masks) if masks else np.zeros(0, bool)
        plain = replace(variant, causal=False, window_left=-1)
        if mask.all():
            mask = None
        return BSRLayout(lay.qo_indptr, lay.kv_indptr, lay.kv_indices, lay.kv_last_len, lay.block_size,
                         lay.num_blocks, mask), plain


def _global_lengths(qo_lens, kv_lens):
    lay = layouts.ragged(qo_lens, kv_lens)  # validates both
    return lay.qo_lens.astype(np.int64), lay.kv_lens.astype(np.int64)


def _rank_positions(kv_len: int, rank: int, world_size: int, sharding: str) -> np.ndarray:
    if sharding == "contiguous":
        return np.arange(kv_len * rank // world_size, kv_len * (rank + 1) // world_size, dtype=np.int64)
    return np.arange(rank, kv_len, world_size, dtype=np.int64)


def shard(qo_lens, kv_lens, *, rank: int, world_size: int, sharding: str = "contiguous") -> Shard:
    """Rank ``rank``'s :class:`Shard` of a ragged batch: its keys in a ragged pool of its own (Bc = 1).

    Parameters
    ----------
    qo_lens, kv_lens : sequence of int, ``[R]``
        The global batch, as :func:`bsrattn.layouts.ragged` takes it.
    rank, world_size : int
    sharding : ``"contiguous"`` or ``"interleaved"``
        Contiguous: rank ``r`` holds positions ``[r*L//W, (r+1)*L//W)`` of a request of ``L`` keys.
        Interleaved: position ``p`` lives on rank ``p % W`` (round-robin by token).

    Examples
    --------
    >>> from bsrattn import distributed
    >>> s = distributed.shard([1], [10], rank=1, world_size=3)
    >>> s.positions.tolist(), s.layout.kv_lens.tolist()
    ([3, 4, 5], [3])
    """
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    world_size = as_int("world_size", world_size, minimum=1)
    rank = as_int("rank", rank, minimum=0, maximum=world_size - 1)
    qo, kv = _global_lengths(qo_lens, kv_lens)
    rows = [_rank_positions(int(n), rank, world_size, sharding) for n in kv]
    positions = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    local = layouts.ragged(qo, [p.size for p in rows])
    return Shard(local, positions, kv, rank, world_size)


def shards(qo_lens, kv_lens, *, world_size: int, sharding: str = "contiguous") -> list:
    """Every rank's :class:`Shard`, ``[shard(..., rank=r) for r in range(world_size)]``: for one process that
    builds all ranks' inputs from one global KV (tests, examples).

    Examples
    --------
    >>> from bsrattn import distributed
    >>> [p.positions.tolist() for p in distributed.shards([1], [5], world_size=2)]
    [[0, 1], [2, 3, 4]]
    """
    world_size = as_int("world_size", world_size, minimum=1)
    return [shard(qo_lens, kv_lens, rank=r, world_size=world_size, sharding=sharding) for r in range(world_size)]


# ---- the exchange -----------------------------------------------------------------------------------------

def _position_hash(positions: np.ndarray) -> int:
    """Sum over ``positions`` of splitmix64 of each, mod 2**64: equal for two sets of distinct positions only
    when they are the same set (but for a 2**-64 chance)."""
    z = positions.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return int(np.sum(z ^ (z >> np.uint64(31)), dtype=np.uint64))


def _error_record(err: BaseException) -> tuple:
    return (type(err).__name__, str(err))


def _raise_failures(records, own_error=None):
    """Raise, on every rank alike, the errors that ``records`` (one ``(type name, message)`` or None per rank)
    hold: a ``TypeError`` when every failing rank raised one, else a ``ValueError``."""
    failed = [(r, rec) for r, rec in enumerate(records) if rec is not None]
    if not failed:
        return
    cls = TypeError if all(kind == "TypeError" for _, (kind, _) in failed) else ValueError
    raise cls("; ".join(f"rank {r}: {message}" for r, (_, message) in failed)) from own_error


def _difference(name, mine, theirs) -> str:
    """What differs between two values of field ``name``: the first differing entry of two sequences."""
    if isinstance(mine, tuple) and isinstance(theirs, tuple) and name.endswith("_lens"):
        if len(mine) != len(theirs):
            return f"{len(mine)} requests in {name}, rank 0 has {len(theirs)}"
        i = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
        return f"{name}[{i}]={mine[i]}, rank 0 has {theirs[i]}"
    return f"{name}={mine!r}, rank 0 has {theirs!r}"


def _coverage_error(request, kv_len, held) -> str:
    """Which positions of ``request`` several ranks hold, and which none does (``held``: rank -> positions)."""
    owners = {}
    for r, pos in enumerate(held):
        for p in pos:
            owners.setdefault(int(p), []).append(r)
    twice = [(p, rs) for p, rs in sorted(owners.items()) if len(rs) > 1]
    missing = sorted(set(range(kv_len)) - owners.keys())
    parts = [f"position {p} is held by ranks {rs}" for p, rs in twice[:3]]
    parts += [f"positions {missing[:8]}{' ...' if len(missing) > 8 else ''} are held by no rank"] if missing else []
    return (f"the shards do not cover request {request}'s kv_len={kv_len} keys exactly once "
            f"({'overlap' if twice else ''}{' and ' if twice and missing else ''}{'gap' if missing else ''}): "
            + "; ".join(parts))


def _check_own_positions(s: Shard):
    """Raise unless each of this shard's positions is in its request's range and held once."""
    for b in range(s.layout.num_rows):
        pos = s.row_positions(b)
        kv_len = int(s.kv_lens[b])
        bad = (pos < 0) | (pos >= kv_len)
        if bad.any():
            raise ValueError(f"request {b}: position {pos[np.argmax(bad)]} is outside [0, kv_len={kv_len})")
        uniq, counts = np.unique(pos, return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"request {b}: position {uniq[np.argmax(counts > 1)]} is held twice")


def _comm_device(group):
    """Where collectives on ``group`` run: the current CUDA device for NCCL, else the CPU (see the module
    docstring: every rank must pick the same backend whatever kind of array it holds)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_bytes(x):
    """A flat uint8 torch view of ``x`` (a NumPy array or a torch tensor), copied only if not contiguous."""
    if isinstance(x, torch.Tensor):
        return x.contiguous().reshape(-1).view(torch.uint8)
    return torch.from_numpy(np.ascontiguousarray(x).reshape(-1).view(np.uint8))


def _from_bytes(buf, like, lead: int):
    """``buf`` (``[lead, nbytes]`` uint8, a NumPy array or a torch tensor) as ``[lead, *like.shape]`` of
    ``like``'s dtype."""
    if isinstance(buf, torch.Tensor):
        return buf.contiguous().view(like.dtype).reshape(lead, *like.shape)
    return np.ascontiguousarray(buf).view(like.dtype).reshape(lead, *like.shape)


class ContextParallelAttention:
    """Context-parallel attention with a plan/run split: plan once per step, run once per layer.

    Every rank of ``group`` builds one, plans with its own :class:`Shard`, and runs with the same ``q`` and
    its own ``k``/``v``; see the module docstring for what is exchanged, what is bitwise, and which variants
    are supported.

    Parameters
    ----------
    backend : str or Backend, optional
        The tier each rank computes its states and folds them with.
    group : ProcessGroup, optional
        Default: the default process group. Its timeout bounds every collective.

    Examples
    --------
    In a group of one rank (every rank of a larger group runs the same lines with its own shard):

    >>> import tempfile, numpy as np, torch.distributed as dist, bsrattn as ba
    >>> from bsrattn import distributed
    >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/group", rank=0, world_size=1)
    >>> part = distributed.shard([2], [6], rank=0, world_size=1)
    >>> cp = distributed.ContextParallelAttention("reference")
    >>> cp.plan(part, num_qo_heads=2, num_kv_heads=1, head_dim=8, variant=ba.Variant(causal=True))
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((2, 2, 8)), rng.standard_normal((6, 1, 8)), rng.standard_normal((6, 1, 8))
    >>> want = ba.attention(q, k, v, ba.layouts.ragged([2], [6]), variant=ba.Variant(causal=True))
    >>> bool(np.allclose(cp.run(q, k[part.global_slots], v[part.global_slots]), want))
    True
    >>> dist.destroy_process_group()
    """

    def __init__(self, backend=None, *, group=None):
        self._backend_arg = backend
        self.group = group
        self._attention = None
        self._sigmoid = False
        self._sinks = None  # the variant's sinks, merged after the ranks' states
        self._sink_state: dict = {}  # kept between calls (state.merge_sinks)

    def plan(self, shard, num_qo_heads, num_kv_heads, head_dim, *, variant=None, q_dtype=None, kv_dtype=None,
             kv_layout="NHD", num_ctas=None, fixed_split_size=None):
        """Check, on every rank together, that the ranks agree and their shards cover the keys; plan the
        local attention (:meth:`bsrattn.BatchAttention.plan`, arguments as there).

        Raises
        ------
        ValueError
            On every rank: a rank's local checks fail (the message names the rank and its error), ranks
            disagree on the plan, or the shards overlap or leave a gap. A ``TypeError`` instead when every
            failing rank's error is one.
        """
        self._plan(shard, num_qo_heads, num_kv_heads, head_dim, variant=variant, q_dtype=q_dtype,
                   kv_dtype=kv_dtype, kv_layout=kv_layout, num_ctas=num_ctas, fixed_split_size=fixed_split_size)

    def _plan(self, shard, num_qo_heads, num_kv_heads, head_dim, *, variant, q_dtype, kv_dtype, kv_layout,
              num_ctas, fixed_split_size, error=None):
        group = self.group
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        self._attention = None
        summary = dict(error=None, fingerprint=None, counts=(), hashes=(), expected=())
        try:
            if error is not None:
                raise error
            if not isinstance(shard, Shard):
                raise TypeError(f"shard must be a bsrattn.distributed.Shard, got {type(shard).__name__}")
            if (shard.rank, shard.world_size) != (rank, world_size):
                raise ValueError(f"shard was made for rank {shard.rank} of world_size={shard.world_size}, but this "
                                 f"is rank {rank} of {world_size}")
            variant = Variant() if variant is None else variant
            attention = BatchAttention(self._backend_arg)
            _check_own_positions(shard)
            local, local_variant = shard.attention_layout(variant)
            attention.plan(local, num_qo_heads, num_kv_heads, head_dim, variant=local_variant, q_dtype=q_dtype,
                           kv_dtype=kv_dtype, kv_layout=kv_layout, num_ctas=num_ctas,
                           fixed_split_size=fixed_split_size,
                           rope_positions=shard.rope_positions() if local_variant.use_rope else None)
            lay = shard.layout
            summary["fingerprint"] = dict(
                qo_lens=tuple(lay.qo_lens.tolist()), kv_lens=tuple(shard.kv_lens.tolist()),
                num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                q_dtype=None if q_dtype is None else dtype_name(q_dtype),
                kv_dtype=None if kv_dtype is None else dtype_name(kv_dtype), kv_layout=kv_layout, variant=variant,
                backend=attention.backend.name)
            summary["counts"] = tuple(np.diff(shard.key_indptr).tolist())
            summary["hashes"] = tuple(_position_hash(shard.row_positions(b)) for b in range(lay.num_rows))
            # Each rank hashes a 1/W slice of 0..L-1, so the sum over ranks is the hash of every position once.
            summary["expected"] = tuple(_position_hash(_rank_positions(int(n), rank, world_size, "contiguous"))
                                        for n in shard.kv_lens)
        except Exception as err:  # re-raised on every rank below, so that no rank waits alone in a collective
            summary["error"], error = _error_record(err), err
        gathered = [None] * world_size
        dist.all_gather_object(gathered, summary, group=group)
        _raise_failures([s["error"] for s in gathered], error)
        reference = gathered[0]["fingerprint"]
        for r, s in enumerate(gathered[1:], start=1):
            differing = [name for name, value in s["fingerprint"].items() if value != reference[name]]
            if differing:
                raise ValueError(f"ranks disagree on the plan: rank {r} has "
                                 + "; ".join(_difference(n, s["fingerprint"][n], reference[n]) for n in differing))
        self._check_coverage(gathered, shard)
        self._attention, self._sigmoid, self._sinks = attention, variant.use_sigmoid, variant.sinks

    def _check_coverage(self, gathered, shard):
        """Raise on every rank unless, per request, the ranks' key counts sum to ``kv_len`` and their position
        hashes to the hash of ``0..kv_len-1``; then gather the positions of the first bad request to say why."""
        kv_lens = shard.kv_lens
        bad = []
        for b, kv_len in enumerate(kv_lens.tolist()):
            count = sum(s["counts"][b] for s in gathered)
            total = sum(s["hashes"][b] for s in gathered) % 2**64
            if count != kv_len or total != sum(s["expected"][b] for s in gathered) % 2**64:
                bad.append(b)
        if not bad:
            return
        held = [None] * len(gathered)
        dist.all_gather_object(held, shard.row_positions(bad[0]).tolist(), group=self.group)
        more = f" ({len(bad) - 1} more requests too)" if len(bad) > 1 else ""
        raise ValueError(_coverage_error(bad[0], int(kv_lens[bad[0]]), held) + more)

    def run(self, q, k, v, *, return_lse=False, k_scale=None, v_scale=None):
        """Attention of ``q`` over every rank's keys: ``out`` (and ``lse``), the same on every rank, bit for bit.

        ``q [nnz_qo, num_qo_heads, head_dim]`` (the same on every rank; only its shape and dtype are checked),
        ``k``/``v`` this rank's pool as the shard's layout addresses it, NumPy arrays or torch tensors of the
        kinds the tier takes. Every rank must call it, and the same number of times.

        Each call all-gathers one status word per rank and reads it on the host before the states are
        exchanged, so that an error on one rank is raised on all: the call synchronises with the device
        once, and as it stands cannot be captured in a CUDA graph.

        Raises
        ------
        ValueError
            On every rank: a rank's inputs do not match its plan, or ranks pass different dtypes.
        """
        if self._attention is None:
            raise RuntimeError("ContextParallelAttention.run called before a successful plan()")
        group, sigmoid = self.group, self._sigmoid
        error = record = None
        o = lse = None
        try:
            if sigmoid and return_lse:
                raise ValueError("return_lse=True, but lse is undefined for sigmoid attention "
                                 "(Variant.sigmoid_bias)")
            if not isinstance(q, (np.ndarray, torch.Tensor)):
                raise TypeError(f"q must be a NumPy array or a torch tensor, got {type(q).__name__}")
            result = self._attention.run(q, k, v, return_lse=not sigmoid, k_scale=k_scale, v_scale=v_scale)
            o, lse = (result, None) if sigmoid else result
            dtype_code = FLOAT_DTYPES.index(dtype_name(q))
        except Exception as err:  # re-raised on every rank below, so that no rank waits alone in a collective
            error, record, dtype_code = err, _error_record(err), -1
        device = _comm_device(group)
        world_size = dist.get_world_size(group)
        status = torch.tensor([record is not None, dtype_code], dtype=torch.int64, device=device)
        statuses = torch.empty(world_size * 2, dtype=torch.int64, device=device)
        _all_gather_single(statuses, status, group=group)
        statuses = statuses.reshape(world_size, 2).tolist()
        if any(failed for failed, _ in statuses):
            records = [None] * world_size
            dist.all_gather_object(records, record, group=group)
            _raise_failures(records, error)
        codes = [code for _, code in statuses]
        if len(set(codes)) > 1:
            r = next(r for r, c in enumerate(codes) if c != codes[0])
            raise ValueError(f"ranks disagree on q's dtype: rank {r} has {FLOAT_DTYPES[codes[r]]}, rank 0 has "
                             f"{FLOAT_DTYPES[codes[0]]}")
        states = (o,) if sigmoid else (o, lse)
        o_all, lse_all = self._gather(states, device) + ((None,) if sigmoid else ())
        if sigmoid:
            out = o_all[0]
            for r in range(1, world_size):
                out = self._attention.backend.add_states(out, o_all[r])
            return out
        # [W, nnz_qo, ...] -> [nnz_qo, W, ...]: merge_states folds axis 1 in index order, that is rank order.
        if isinstance(o_all, torch.Tensor):
            o_all, lse_all = o_all.transpose(0, 1).contiguous(), lse_all.transpose(0, 1).contiguous()
        else:
            o_all, lse_all = np.ascontiguousarray(o_all.swapaxes(0, 1)), np.ascontiguousarray(lse_all.swapaxes(0, 1))
        out, lse = merge_states(o_all, lse_all, backend=self._attention.backend)
        if self._sinks is not None:  # once, into the merged state: no rank's attention counts them
            out, lse = merge_sinks(self._attention.backend, out, lse, self._sinks, self._sink_state)
        return (out, lse) if return_lse else out

    def _gather(self, states, device) -> tuple:
        """All ranks' ``states`` (arrays of one kind), each ``[W, *shape]``: one all-gather of their bytes."""
        parts = [_as_bytes(x) for x in states]
        sizes = [p.numel() for p in parts]
        local = torch.cat(parts).to(device)
        world_size = dist.get_world_size(self.group)
        gathered = torch.empty(world_size * local.numel(), dtype=torch.uint8, device=device)
        _all_gather_single(gathered, local, group=self.group)
        gathered = gathered.reshape(world_size, local.numel())
        first = states[0]
        gathered = gathered.to(first.device) if isinstance(first, torch.Tensor) else gathered.cpu().numpy()
        out, at = [], 0
        for x, size in zip(states, sizes):
            out.append(_from_bytes(gathered[:, at:at + size], x, world_size))
            at += size
        return tuple(out)


def _heads(q, k, kv_layout):
    """``(num_qo_heads, num_kv_heads, head_dim)`` read off ``q`` and ``k``."""
    for name, x in (("q", q), ("k", k)):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    q_shape, k_shape = shape_of(q), shape_of(k)
    if len(q_shape) != 3:
        raise ValueError(f"q has shape {q_shape}, expected [nnz_qo, num_qo_heads, head_dim]")
    if len(k_shape) not in (3, 4):
        raise ValueError(f"k has shape {k_shape}, expected 3-D or 4-D")
    num_kv_heads = k_shape[1] if kv_layout == "HND" else k_shape[-2]
    return q_shape[1], num_kv_heads, q_shape[2]


def context_parallel_attention(q, k_local, v_local, shard, *, variant=None, group=None, backend=None,
                               kv_layout="NHD", return_lse=False):
    """One call of :class:`ContextParallelAttention`: plan with ``shard``, then run; heads and ``head_dim`` are
    read off ``q`` and ``k_local``.

    Parameters
    ----------
    q : ``[nnz_qo, num_qo_heads, head_dim]``
        The whole batch's queries, the same on every rank.
    k_local, v_local : arrays
        This rank's KV pool, as ``shard.layout`` addresses it (``[N_local, num_kv_heads, head_dim]`` for a
        shard made by :func:`shard`).
    shard : Shard
        This rank's shard.
    variant, backend, kv_layout, return_lse
        As in :func:`bsrattn.attention`.
    group : ProcessGroup, optional
        Default: the default process group. Its timeout bounds every collective.

    Returns
    -------
    out or (out, lse)
        The same on every rank, bit for bit.

    Examples
    --------
    On each rank, after ``torch.distributed.init_process_group`` (here a group of one):

    >>> import tempfile, numpy as np, torch.distributed as dist, bsrattn as ba
    >>> from bsrattn import distributed
    >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/group", rank=0, world_size=1)
    >>> part = distributed.shard([1], [6], rank=dist.get_rank(), world_size=dist.get_world_size(),
    ...                          sharding="interleaved")
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((1, 2, 8)), rng.standard_normal((6, 1, 8)), rng.standard_normal((6, 1, 8))
    >>> out, lse = distributed.context_parallel_attention(q, k[part.global_slots], v[part.global_slots], part,
    ...                                                   return_lse=True)
    >>> out.shape, lse.shape
    ((1, 2, 8), (1, 2))
    >>> dist.destroy_process_group()
    """
    attention = ContextParallelAttention(backend, group=group)
    try:
        heads, error = _heads(q, k_local, kv_layout), None
    except (TypeError, ValueError) as err:
        heads, error = (None, None, None), err
    attention._plan(shard, *heads, variant=variant, q_dtype=None, kv_dtype=None, kv_layout=kv_layout,
                    num_ctas=None, fixed_split_size=None, error=error)
    return attention.run(q, k_local, v_local, return_lse=return_lse)

