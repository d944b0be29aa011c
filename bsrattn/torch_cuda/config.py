"""Tile shapes and launch parameters: what ``plan_options`` gives the scheduler and what the kernel is built with.

Two shapes of work, one kernel:

- **decode** (a handful of query rows per block row): the tile's M dimension is the GQA group's query heads
  times the query rows (``tile_q * group_size``), padded to 16 for ``tl.dot``. The kernel is
  bandwidth-bound: the plan splits the KV so that every SM streams.
- **prefill** (long query rows): ``BLOCK_M = 128`` query rows x heads amortise each KV tile over many
  queries; no splits when there are at least as many query tiles as CTAs, and then a kernel without the
  merges (``LaunchConfig.merges``), which keeps a tile's state in registers instead of spilling it.

``num_ctas`` is CTAs per KV head (the scheduler's unit): the launch is ``num_ctas x num_kv_heads``
programs, a fixed number of waves of the GPU, read from the device's SM count: two CTAs per SM at decode
(both resident), four at prefill (one resident: the others queue, so the hardware evens out what the static
plan cannot see, the causal triangle's unequal tiles). A decode batch of few
(row, KV head) pairs, at most one per ``DECODE_FEW_PAIRS_PER`` SMs, whose tiles hold at most ``DECODE_FEW_ROWS``
rows, is balanced over one CTA per SM (``busy_ctas``), the launch grid's other CTAs left empty, and runs 8 warps: each
pair's KV is split over many CTAs anyway, and longer items with more loads in flight each beat twice the items
merged through memory. (The launch grid stays at two CTAs per SM so that a captured CUDA graph, which records it,
replays any batch's plan.) Taller tiles, such as a cascade's shared-prefix level, which puts a whole batch's
queries in one block row, compute more per KV tile, and two CTAs per SM overlap one's loads with the other's
math.

Decode chunks are whole KV tiles (``kv_align = BLOCK_N``) of at least ``DECODE_MIN_SPLIT`` slots: with chunks of
exactly ``L_kv`` the per-row ceilings leave a few more items than CTAs, so a second wave of a handful of items
doubles the makespan; aligned chunks fit one wave, and the minimum stops a small budget from being cut into
2-tile items whose prologue and merge dominate. A split prefill-shaped row's chunks are at least
:func:`split_keys` long, the keys whose K and V outweigh the item's partial state: one program folds a row's
states, and a 128-row tile cut into 8-key chunks took 5 ms (W11's MLA decode, before :func:`head_groups` made it
a decode). The other choices here
were measured (``benchmarks/tune.py``; the figures are in ``benchmarks/NOTES.md``, the torch tier's ladder). A
caller who passes ``num_ctas`` to ``BatchAttention.plan`` gets Algorithm 1 exactly at that count, without these
bounds.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import astuple, dataclass, fields
from typing import NamedTuple

import numpy as np

from bsrattn.indexing import ceil_div

DECODE_ROWS = 64
"""A tile whose query rows x group heads fit in this many rows is run with the decode shapes."""

CTAS_PER_SM = {"decode": 2, "prefill": 4}
DECODE_FEW_PAIRS_PER = 4
DECODE_FEW_ROWS = 16
"""A decode batch of at most ``num_sms // DECODE_FEW_PAIRS_PER`` (row, KV head) pairs, whose tiles hold at most
``DECODE_FEW_ROWS`` rows (query rows x group heads), is balanced over one CTA per SM."""
DECODE_MIN_SPLIT = 256
PREFILL_BLOCK_M = 128
INTERPRETER_SMS = 4
"""SMs the Triton interpreter pretends to have: few programs keep CI fast, and splits still happen."""


@dataclass(frozen=True)
class Tiles:
    """The tile shapes and software pipelining of one launch (see :func:`tiles`)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _interpret_set() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_INTERPRETING = _interpret_set()  # read as the tier's kernels are decorated, when Triton makes the same choice


def interpreting() -> bool:
    """Whether Triton runs this tier's kernels in its CPU interpreter (``TRITON_INTERPRET=1``): as the variable
    stood when the tier was imported, when ``triton.jit`` chose between the interpreter and the compiler for its
    kernels; a later change does not move them (:func:`interpreter_changed`)."""
    return _INTERPRETING


def interpreter_changed() -> bool:
    """Whether ``TRITON_INTERPRET`` now says otherwise than when the tier was imported: it was set (or unset) too
    late, and only a restart with it set before the import moves the kernels."""
    return _interpret_set() != _INTERPRETING


_interpreter = threading.Lock()


def interpreter_turn():
    """A context in which to launch a kernel: under the interpreter, one launch at a time (its state is per
    process, and two Python threads launching at once would share it); compiled, nothing."""
    return _interpreter if interpreting() else contextlib.nullcontext()


def block_d(head_dim: int) -> int:
    """The kernel's tile of a head dimension: a power of two >= 16 (``tl.dot``'s K), the tail masked; of ``q`` and
    ``k`` (``LaunchConfig.block_d``), or of ``v`` and ``out`` (``LaunchConfig.block_dv``)."""
    return max(16, next_pow2(head_dim))


def wide_heads(spec) -> bool:
    """Whether a head dimension of ``spec``, ``q``'s and ``k``'s or ``v``'s, takes a tile over 128 wide: then
    :func:`tiles` gives M tiles of at most 64 rows."""
    return max(block_d(spec.head_dim), block_d(spec.dim_vo)) > 128


def block_m(tile_q: int, group_size: int) -> int:
    """M tile for ``tile_q`` query rows of a GQA group: 16..128 rows; larger items loop over M sub-tiles."""
    return min(128, max(16, next_pow2(tile_q * group_size)))


def tiles(m: int, head_dim: int, dtype: str, few_items: bool = False, head_dim_vo: int | None = None,
          value_in_key: bool = False) -> Tiles:
    """Tile shapes for an M tile of ``m`` rows. ``dtype`` is ``q``'s (fp32 dots run on CUDA cores: smaller tiles);
    ``head_dim_vo`` is ``v``'s head dimension where it is not ``head_dim``'s, and the wider of the two tiles decides.

    Chosen by ``benchmarks/tune.py``'s sweeps (``benchmarks/NOTES.md``). Decode streams KV: 3 pipeline stages keep two
    tiles in flight behind the one being used (the tile's block ids are loaded a tile ahead), and two CTAs of 4 warps
    share an SM. A decode plan with ``few_items`` (fewer busy programs than SMs) leaves SMs idle whatever the tile; 8
    warps then put more loads in flight for each item. Prefill is FLOP-bound: 128 x 64 tiles on 8 warps (two warpgroups
    of wgmma), 3 stages. Shared memory per stage is ``block_n x block_d`` for each of K and V; every choice keeps a CTA
    inside the H200's 227 KiB (two per SM at decode shapes). Where K's and V's tiles together are over 1024 wide
    (multi-head latent attention's 576-wide key, a 1024 tile, beside its 512-wide value), 32 x 16 tiles keep ``q`` and
    two stages of K and V inside it (the sm_90 compile check). With ``value_in_key`` (``LaunchConfig.value_in_key``:
    the V tile is the K tile's first part) over 512 wide in all, MLA's 512 + 64, the accumulator and the query's
    first part fill the registers: 64 x 64 tiles on 8 warps, whose products are ``wgmma``, spill 1.2-1.9 KiB a
    thread (loop-invariant operand descriptors, reloaded from L1) and are still faster than the 32 x 16
    ``mma.sync`` tile that spills nothing, at every batch W11 times.
    """
    block_dv = block_d(head_dim if head_dim_vo is None else head_dim_vo)
    if value_in_key and block_dv + block_d(head_dim - head_dim_vo) > 512:
        return Tiles(block_m=min(m, 64), block_n=64, num_warps=8, num_stages=2)
    if block_d(head_dim) + block_dv > 1024:
        return Tiles(block_m=min(m, 32), block_n=16, num_warps=4, num_stages=2)
    if max(block_d(head_dim), block_dv) > 128 or dtype == "float32":
        return Tiles(block_m=min(m, 64), block_n=32, num_warps=4, num_stages=2)
    if m <= DECODE_ROWS:
        return Tiles(block_m=m, block_n=64, num_warps=8 if few_items else 4, num_stages=3)
    return Tiles(block_m=m, block_n=64, num_warps=8, num_stages=3)


_SMS = {}  # CUDA device index -> SM count: a device's properties do not change, and reading them is slow


def num_sms(device=None) -> int:
    """SMs of ``device`` (the current CUDA device by default); :data:`INTERPRETER_SMS` in the interpreter."""
    import torch

    if interpreting() or not torch.cuda.is_available():
        return INTERPRETER_SMS
    index = None if device is None else torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def value_may_be_in_key(spec) -> bool:
    """Whether a call of ``spec`` can read its value from its key's tile (``LaunchConfig.value_in_key``): a value
    narrower than the key (multi-head latent attention's ``ckv`` in its key ``ckv ⊕ kpe``) and no fused RoPE, which
    turns the key's halves, not its parts. Whether a call does is its tensors' (``runner._value_in_key``); multi-head
    latent attention's calls always pass the value so."""
    return spec.head_dim_vo is not None and spec.head_dim_vo < spec.head_dim and not spec.variant.use_rope


def head_groups(spec) -> int:
    """How many groups a KV head's query heads run in, each group's programs reading the KV head's tiles on their
    own (the launch grid's second dimension is ``num_kv_heads x head_groups``): 1, unless the GQA group alone, one
    query row's heads, is taller than a decode tile's :data:`DECODE_ROWS`. Then the fewest groups whose rows, over
    the step's tallest block row, fit :data:`DECODE_ROWS`: multi-head latent attention's 128 query heads over one
    latent head decode as 2 groups of 64, each one 64-row tile (:func:`tiles`; groups of 32 heads on 32-row tiles
    are faster at batch 1 and slower from batch 32, ``benchmarks/NOTES.md``). As one tile of 128
    rows such a step would plan as a prefill (its row at batch 1 cut into chunks whose many partial states one
    program folds); as groups it plans as a decode, whose groups stream the same keys side by side and fold their
    states apart. A block row taller than a tile even at one head a group keeps one group."""
    group = spec.group_size
    if group <= DECODE_ROWS:
        return 1
    qo = spec.layout.qo_lens
    tallest = int(qo.max()) if qo.size else 1
    return next((n for n in range(2, group + 1) if group % n == 0 and tallest * (group // n) <= DECODE_ROWS), 1)


def plan_options(spec, device=None) -> dict:
    """Scheduler options for ``spec``: ``num_ctas`` (per KV head), ``tile_q``, ``min_split_size``, ``kv_align``,
    ``busy_ctas`` (decode), and ``lead_items`` (deterministic mode: the kernel folds an item's chunks itself, so a
    row's first item covers the normal plan's chunk, rounded onto the chunk grid of ``split_size``).

    Examples
    --------
    >>> import bsrattn as ba
    >>> from bsrattn.validation import make_spec
    >>> spec = make_spec(ba.layouts.ragged([1, 1], [300, 40]), 8, 2, 64)
    >>> opts = plan_options(spec)
    >>> opts["tile_q"], opts["min_split_size"], opts["kv_align"]
    (4, 256, 64)
    """
    qo = spec.layout.qo_lens
    tallest = int(qo.max()) if qo.size else 1
    groups = head_groups(spec)
    group = spec.group_size // groups  # query heads a program's tile holds
    programs = spec.num_kv_heads * groups  # the launch grid's second dimension
    # Decode: every block row's query rows x group heads fit one small tile.
    kind = "decode" if tallest * group <= DECODE_ROWS else "prefill"
    if kind == "decode":
        m = block_m(tallest, group)
    else:
        m = 64 if wide_heads(spec) or spec.q_dtype == "float32" else PREFILL_BLOCK_M
    ctas = max(1, num_sms(device) * CTAS_PER_SM[kind] // programs)
    if kind == "decode":
        # The tile a launch will take: chunks of whole KV tiles (a call whose value turns out apart from its key
        # runs narrower tiles, over chunks that are still whole tiles of them).
        block_n = tiles(m, spec.head_dim, spec.q_dtype, head_dim_vo=spec.head_dim_vo,
                        value_in_key=value_may_be_in_key(spec)).block_n
        sms = num_sms(device)
        few_pairs = m <= DECODE_FEW_ROWS and spec.layout.num_rows * programs * DECODE_FEW_PAIRS_PER <= sms
        return dict(num_ctas=ctas, tile_q=max(1, m // group), min_split_size=DECODE_MIN_SPLIT,
                    kv_align=block_n, busy_ctas=max(1, min(ctas, sms // programs)) if few_pairs else ctas,
                    lead_items=spec.split_size is not None)
    tile_q = max(1, m // group)
    # As many query tiles as CTAs or more: every CTA has whole tiles to run, so no row is split (a chunk as long
    # as the longest row), and the kernel carries no merges (LaunchConfig.merges). Fewer tiles (a short prefill
    # over a long cache, or an MLA prefill, whose one latent head gives a tile of every query head): the rows are
    # split so that every CTA streams, in chunks that outweigh their partial states (split_keys).
    query_tiles = int(np.sum(ceil_div(qo, tile_q)))
    min_split = int(spec.layout.kv_lens.max(initial=1)) if query_tiles >= ctas else split_keys(spec, tile_q)
    return dict(num_ctas=ctas, tile_q=tile_q, min_split_size=max(1, min_split), kv_align=1,
                lead_items=spec.split_size is not None)


def split_keys(spec, tile_q: int) -> int:
    """The fewest keys in a split item of a prefill-shaped tile of ``tile_q`` query rows: as many as make the K and
    V it reads at least its partial state (``tile_q x group_size x dim_vo`` float32), which the item writes and the
    one program that folds its row's states reads back. With chunks any shorter the fold, which runs alone, reads
    more than the items stream: a 128-head MLA decode row over 4096 keys cut for 528 CTAs into 8-key chunks is 512
    states of 256 KiB folded by one program (``benchmarks/NOTES.md``, W11)."""
    kv_bytes = 1 if spec.kv_is_fp8 else 4 if spec.kv_dtype == "float32" else 2
    state = tile_q * spec.group_size * spec.dim_vo * 4
    return ceil_div(state, (spec.head_dim + spec.dim_vo) * kv_bytes)


ITEM_KERNEL, ITEM_KERNEL_TMA = 1, 2
"""``LaunchConfig.item_kernel``: the item kernel (``item_kernel.py``) with gathered loads, or reading affine rows
through tensor descriptors."""
ITEM_TMA_MIN_KV = 4096
"""The item kernel reads affine rows through tensor descriptors for plans whose items average this many KV slots
or more: a long row gains, a short row's few tiles do not repay making its descriptors (``benchmarks/NOTES.md``)."""


def causal_hides_keys(spec) -> bool:
    """Whether the variant's causal mask hides any key of the spec's layout: not when every row has at most one
    query (a decode step's query sits at its row's last position and sees every key). Where it hides none the
    kernel runs without it, and so without the second pass that only a hidden key's non-finite value needs."""
    qo = spec.layout.qo_lens
    return spec.variant.causal and qo.size > 0 and int(qo.max()) > 1


DECODE_CHAIN_ITEMS = 2
DECODE_SHORT_ITEM = 256
"""A decode plan runs the item kernel where its tiles hold more than :data:`DECODE_FEW_ROWS` rows, or where the
persistent kernel's CTAs would each run a chain of short items: :data:`DECODE_CHAIN_ITEMS` items a CTA or more,
of :data:`DECODE_SHORT_ITEM` KV slots or fewer on average. Such a chain restarts the KV pipeline at every item,
one after another, where one program per item lets an SM overlap one item's start with another's loads. Elsewhere
(long items, few items a CTA) the persistent kernel is faster (``benchmarks/NOTES.md`` has both sides' figures)."""


def decode_on_items(work_plan, rows: int) -> bool:
    """Whether a decode plan whose tiles hold ``rows`` rows runs the item kernel (:data:`DECODE_CHAIN_ITEMS`)."""
    if rows > DECODE_FEW_ROWS:
        return True
    kv = work_plan.item_kv_end - work_plan.item_kv_start
    return kv.size >= DECODE_CHAIN_ITEMS * work_plan.num_ctas and kv.mean(dtype=np.float64) <= DECODE_SHORT_ITEM


def item_kernel_for(spec, work_plan, q_dtype: str, affine_rows: bool, group: int) -> int:
    """``LaunchConfig.item_kernel`` for ``work_plan``, whose tiles pack ``group`` query heads a query row (a head
    group's, :func:`head_groups`): 0 (the persistent kernel) unless the item kernel
    (``item_kernel.py``) runs it: a plan whose tiles fit one M tile, whose variant the item kernel has (at most a causal
    mask and a soft cap; not deterministic), that splits no row where the causal mask hides keys, and, for decode tiles,
    that :func:`decode_on_items` picks; then :data:`ITEM_KERNEL_TMA` for a plan with ``affine_rows`` whose items average
    :data:`ITEM_TMA_MIN_KV` slots or more, else :data:`ITEM_KERNEL`."""
    variant = spec.variant
    rows = work_plan.tile_q * group
    if ((work_plan.num_merges and causal_hides_keys(spec)) or spec.split_size is not None or rows > PREFILL_BLOCK_M
            or (rows <= DECODE_ROWS and not decode_on_items(work_plan, rows))
            or q_dtype == "float32" or wide_heads(spec) or variant.window_left >= 0
            or variant.alibi_slopes is not None or variant.use_rope or variant.use_sigmoid
            or spec.layout.custom_mask is not None):
        return 0
    kv = work_plan.item_kv_end - work_plan.item_kv_start
    return ITEM_KERNEL_TMA if affine_rows and kv.mean(dtype=np.float64) >= ITEM_TMA_MIN_KV else ITEM_KERNEL


KV_VIEWS = ("NHD", "HND", "NHD3")


@dataclass(frozen=True)
class LaunchConfig:
    """What a launch fixes: its launch grid and its compile-time constants. A CUDA graph records all of these.

    Crosses the custom-op boundary as a list of ints (:meth:`to_list`, :meth:`from_list`).
    """

    num_ctas: int
    num_kv_heads: int
    group_size: int
    head_dim: int
    block_size: int
    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int
    kv_view: str
    causal: bool
    window_left: int
    soft_cap: bool
    alibi: bool
    sigmoid: bool
    rope: bool
    custom_mask: bool
    store_lse: bool
    affine_rows: bool
    """Whether the kernel carries the affine load path (``gather.py``): when some row of the plan is affine. The
    sparse path serves every row, so a graph captured without it stays correct when later plans have some."""
    merges: bool = True
    """Whether the kernel carries the split rows' partial-state stores and merges: when the plan splits some row.
    Without them the kernel keeps fewer values live (a prefill tile's state stays in registers, where with them it
    spills), but runs only plans that split nothing: a graph captured without them must
    be recaptured for a plan that splits (the runner warns). Deterministic mode always carries them: its contract
    includes a graph replayed across re-plans, and which rows a plan cuts changes with the batch."""
    item_kernel: int = 0
    """Which kernel runs the first pass: 0 the persistent kernel, else the item kernel (``item_kernel.py``),
    :data:`ITEM_KERNEL` or :data:`ITEM_KERNEL_TMA` (:func:`item_kernel_for` chooses). The item kernel runs any plan
    without merges correctly, so a graph captured on it replays such re-plans."""
    split_size: int = 0
    """Deterministic mode's chunk size (``AttentionSpec.split_size``; 0 in normal mode): an item longer than a
    chunk folds its chunks' states itself, one by one (``deterministic.py``, ``scheduler.plan``'s ``lead_items``).
    In this mode a row's bits must not depend on the tile it sits in.
    The dots already do not: on the H200, ``q @ k^T`` and ``p @ v`` give the same bits per element whether
    ``mma`` (16 rows) or ``wgmma`` (64 or 128 rows) computes them, on 1 to 8 warps. What does: a row sum
    (``tl.sum``) split over warps, and where the compiler fuses a multiply with an add (it depends on the code
    around: a tile run with masks and the same tile without would round differently). So the softmax's
    running sum is taken on the tensor cores too (``p @ 1``, the weights ``p @ v`` uses) and the kernel compiles
    without FMA fusion (Triton's ``enable_fp_fusion``)."""

    prior: bool = False
    """Whether the launch folds an earlier level's state into every row it writes out (``Runner.run``'s ``prior``:
    a Cascade's last level folds the levels before it, so the cascade needs no launch of its own for the merge);
    the call decides it, not the plan, so a graph captured on a cascade's levels replays its re-plans."""
    head_dim_vo: int | None = None
    """The head dimension of ``v`` and ``out`` (``AttentionSpec.dim_vo``): narrower than ``head_dim`` for multi-head
    latent attention; None (``head_dim``) is replaced by ``head_dim`` on construction. The value tile, the
    accumulator, the partial states and the merges are ``block_dv`` wide; ``q``, ``k`` and the scores ``block_d``."""
    block_dv: int | None = None
    """The tile of ``head_dim_vo`` (:func:`block_d`); None (``block_d``) is replaced by ``block_d``."""
    value_in_key: bool = False
    """Whether ``v`` is the first ``head_dim_vo`` columns of ``k`` (a view of them: multi-head latent attention's
    value ``ckv`` in its key ``ckv ⊕ kpe``): the kernel then loads ``q`` and each K tile in two parts, those columns
    (``block_d`` is their tile, as wide as ``block_dv``) and the rest (:attr:`block_dr`), and uses the first part
    of the K tile as the V tile. The call decides it, as it passes ``v``."""
    head_groups: int = 1
    """How many groups each KV head's query heads run in (:func:`head_groups`): the launch grid's second dimension is
    :attr:`head_programs`, and each program's tile holds :attr:`tile_group` query heads of its KV head."""

    def __post_init__(self):
        if self.head_dim_vo is None:
            object.__setattr__(self, "head_dim_vo", self.head_dim)
        if self.block_dv is None:
            object.__setattr__(self, "block_dv", self.block_d)

    @property
    def block_dr(self) -> int:
        """With :attr:`value_in_key`, the tile of the key's columns past the value's (``head_dim - head_dim_vo``);
        0 otherwise."""
        return block_d(self.head_dim - self.head_dim_vo) if self.value_in_key else 0

    @property
    def head_programs(self) -> int:
        """The launch grid's second dimension: one program a KV head's head group."""
        return self.num_kv_heads * self.head_groups

    @property
    def tile_group(self) -> int:
        """The query heads of one head group, which a tile's rows pack (the kernels' ``GROUP_SIZE``)."""
        return self.group_size // self.head_groups

    @property
    def deterministic(self) -> bool:
        """Whether this is a deterministic launch (``split_size`` > 0)."""
        return self.split_size > 0

    @property
    def hidden_keys(self) -> bool:
        """Whether the masks hide keys from some queries (causal, window, custom mask): then a second pass
        redoes the items whose output came out non-finite (``executor.py``)."""
        return self.causal or self.window_left >= 0 or self.custom_mask

    def to_list(self) -> list:
        return [KV_VIEWS.index(v) if isinstance(v, str) else int(v) for v in astuple(self)]

    @classmethod
    def from_list(cls, values) -> "LaunchConfig":
        kw = {}
        for f, v in zip(fields(cls), values):
            kw[f.name] = KV_VIEWS[v] if f.name == "kv_view" else (bool(v) if f.type == "bool" else int(v))
        return cls(**kw)


class Scalars(NamedTuple):
    """The float arguments of a launch: ``qk_scale = sm_scale * k_scale``, ``v_scale``, soft cap, sigmoid bias.

    A named tuple: it crosses the custom-op boundary as ``list(scalars)``, which ``torch.compile`` traces."""

    qk_scale: float
    v_scale: float
    soft_cap: float
    sigmoid_bias: float
