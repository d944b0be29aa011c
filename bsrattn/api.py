"""The public entry points, each routed through the backend flag: one call, three tiers."""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import TYPE_CHECKING

from bsrattn import scheduler
from bsrattn._types import Array, DType
from bsrattn.backends import Backend, get_backend
from bsrattn.layout import BSRLayout, Cascade
from bsrattn.state import merge_sinks, write_into
from bsrattn.validation import FLOAT_DTYPES, AttentionSpec, check_array, check_deterministic, check_on_grid, \
    check_rope_positions, dtype_name, make_spec, shape_of, spec_from_inputs
from bsrattn.variant import Variant

if TYPE_CHECKING:
    from bsrattn.scheduler import WorkPlan

__all__ = ["attention", "BatchAttention", "merge_state", "merge_states"]

_PLAIN = Variant()


def _levels(layout):
    if isinstance(layout, Cascade):
        return layout.levels
    if isinstance(layout, BSRLayout):
        return (layout,)
    raise TypeError(f"layout must be a BSRLayout or a Cascade, got {type(layout).__name__}")


def _level_variant(layout, level, variant):
    return layout.level_variant(level, variant) if isinstance(layout, Cascade) else variant


def _positioned(layout, level, spec, rope_positions=None):
    """``spec`` of level ``level`` of ``layout``, with fused RoPE's positions when they are not the layout's own:
    a Cascade level's in the whole sequence (``Cascade.rope_positions``), or the caller's ``rope_positions``."""
    if isinstance(layout, Cascade):
        if rope_positions is not None:
            raise ValueError("rope_positions is for a BSRLayout: a Cascade's levels turn at their positions in the "
                             "whole sequence (Cascade.rope_positions)")
        if spec.variant.use_rope:
            return replace(spec, rope_positions=layout.rope_positions(level))
        return spec
    if rope_positions is None:
        return spec
    return replace(spec, rope_positions=check_rope_positions(layout, spec.variant, rope_positions))


def _spec_args(spec) -> tuple:
    """``spec``'s fields after its layout: the arguments besides the layout that :func:`make_spec` built it from."""
    return (spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.variant, spec.q_dtype, spec.kv_dtype,
            spec.kv_view)


def _reusable(spec, variant) -> bool:
    """Whether ``spec`` (checked on an earlier plan with the same arguments) holds for ``variant``."""
    return spec.variant is variant or spec.variant == variant


def _fold_states(backend, states, variant):
    """The levels' states folded in level order with ⊕ (or by addition for FlashSigmoid)."""
    o, s = states[0]
    for o_b, s_b in states[1:]:
        if variant.use_sigmoid:
            o = backend.add_states(o, o_b)
        else:
            o, s = backend.merge_state(o, s, o_b, s_b)
    return o, s


def _merge_levels(backend, run_level, num_levels, variant, out, lse, return_lse, sink_rows=None):
    """Every level's state, folded in level order (:func:`_fold_states`), then the sinks (``sink_rows``: where their
    state is kept between calls, see :func:`~bsrattn.state.merge_sinks`), into ``out``/``lse``.

    ``run_level(i, out=, lse=, return_lse=)`` runs level ``i``. On a tier whose kernel folds a prior state
    (:attr:`Backend.folds_prior`), the last level runs with the others' fold as ``prior=`` and writes ``out``/``lse``
    itself: no launch for the merge, and no copy into the caller's buffers."""
    if backend.folds_prior and num_levels > 1 and not variant.use_sigmoid and variant.sinks is None:
        prior = _fold_states(backend, [run_level(i, out=None, lse=None, return_lse=True)
                                       for i in range(num_levels - 1)], variant)
        return run_level(num_levels - 1, out=out, lse=lse, return_lse=return_lse, prior=prior)
    states = [run_level(i, out=None, lse=None, return_lse=not variant.use_sigmoid) for i in range(num_levels)]
    o, s = _fold_states(backend, states, variant)
    if variant.sinks is not None:
        o, s = merge_sinks(backend, o, s, variant.sinks, sink_rows)
    return write_into(o, s, out, lse)


def _slot_view(x, kv_layout):
    """A KV pool ``[num_blocks, block_size, Hkv, D]`` (NHD; HND ``[num_blocks, Hkv, block_size, D]``) as one slot
    per row, ``[num_blocks * block_size, Hkv, D]``: the storage of :meth:`Cascade.flatten`'s layout (a view of an
    NHD pool, a copy of an HND one). A 3-D pool is one slot per row already."""
    if len(shape_of(x)) == 3:
        return x
    if kv_layout == "HND":
        x = x.swapaxes(1, 2)
    n, b, h, d = shape_of(x)
    return x.reshape(n * b, h, d)


def _deterministic_layout(layout, rope_positions):
    """The layout a deterministic plan runs: a BSRLayout itself; a Cascade as its one flattened layout, each
    query's keys of every level in order, so that the chunk grid runs through the levels as through flat KV."""
    if not isinstance(layout, Cascade):
        return layout
    if rope_positions is not None:
        raise ValueError("rope_positions is for a BSRLayout: a Cascade's levels turn at their positions in the "
                         "whole sequence (Cascade.rope_positions)")
    return layout.flatten()


def attention(q: Array, k: Array, v: Array, layout: BSRLayout | Cascade, *, variant: Variant | None = None,
              backend: str | Backend | None = None, kv_layout: str = "NHD", return_lse: bool = False,
              out: Array | None = None, lse: Array | None = None, k_scale: float | None = None,
              v_scale: float | None = None, rope_positions: tuple | None = None, deterministic: bool = False,
              split_size: int | None = None) -> Array | tuple[Array, Array]:
    """Attention of every query row over its KV, for any layout.

    Parameters
    ----------
    q : array, ``[nnz_qo, num_qo_heads, head_dim]``
        The queries, one row per query of every block row, in the layout's ``qo_indptr`` order (float32,
        float16 or bfloat16).
    k, v : arrays
        ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD), ``[num_blocks, num_kv_heads, block_size,
        head_dim]`` (``kv_layout="HND"``) or ``[N, num_kv_heads, head_dim]`` when ``block_size == 1``.
    layout : BSRLayout or Cascade
        Which KV slots each query row reads (a Cascade: levels whose states are merged with ⊕).
    variant : Variant, optional
        How scores become weights (scale, masks, soft cap, ALiBi, FlashSigmoid); default ``Variant()``.
    backend : str or Backend, optional
        ``"reference"``, ``"numba"``, ``"torch"`` or ``"auto"``; default: the flag (see :mod:`bsrattn.backends`).
    kv_layout : {"NHD", "HND"}
        The storage order of ``k`` and ``v`` (see above).
    return_lse : bool
        Also return ``lse [nnz_qo, num_qo_heads]``, float32, natural log.
    out, lse : arrays, optional
        Buffers to write into.
    k_scale, v_scale : float, optional
        Scales of the stored K and V, of any KV dtype (fp8's dequantisation scales): scores are
        taken with ``k * k_scale`` and outputs made of ``v * v_scale``. None: 1.
    rope_positions : pair of int arrays, optional
        Where fused RoPE turns the queries and keys of a BSRLayout when not at the layout's own positions
        (FlashInfer's ``q_rope_offset``/``k_rope_offset``): ``(q_positions [nnz_qo], kv_offsets [R])``, each query
        row's position and that of each row's first slot (slot ``j`` at ``kv_offsets[r] + j``). None: a query at
        ``kv_len - qo_len + i``, slot ``j`` at ``j``. Only with ``variant.rope_theta``; a Cascade computes its own.
    deterministic : bool
        Partition-invariant mode: each query row's ``out`` and ``lse`` are bitwise the same however the work is
        cut (the rest of the batch, ``num_ctas``, a Cascade or flat KV, one call or chunks merged with
        :func:`merge_state`, a decode step or a row of a prefill). See :meth:`BatchAttention.plan`.
    split_size : int, optional
        Deterministic mode's chunk grid, KV slots per chunk at absolute positions, a multiple of 64; default
        ``bsrattn.validation.DEFAULT_SPLIT_SIZE`` (1024). Only with ``deterministic=True``.

    Returns
    -------
    out or (out, lse)
        ``(out, lse)`` when ``return_lse``, else ``out``. ``out`` has ``q``'s dtype and array kind. A query that
        sees no key gets ``out = 0`` and ``lse = -inf``.

    Raises
    ------
    TypeError
        ``q``, ``k``, ``v``, ``out`` or ``lse`` not an array (a list, None), dtypes that are not supported or do
        not match, a scale that is not a real number.
    ValueError
        Shapes that do not fit the layout or each other, a read-only ``out``/``lse``, a torch tensor on the
        meta device, ``rope_positions`` of the wrong lengths or without fused RoPE; in deterministic mode, a
        ``split_size`` that is not a multiple of 64 or a row that ``rope_positions`` starts off the chunk grid.

    Notes
    -----
    These checks run before a tier is called; a call over a BSRLayout like the last one that passed them (the
    same layout object, variant and ``kv_layout``, arguments of the same types, shapes, dtypes, devices and
    writability, the same flags and scales, no ``rope_positions``) skips them, as :meth:`BatchAttention.run`
    does. A tier adds its own: the devices it can use, and the torch tier
    under the Triton interpreter refuses bfloat16 ``q``/``k``/``v`` (``TypeError``), which it computes wrongly.

    NaN and infinities, the same on every tier (per query row and head; see
    :mod:`bsrattn.reference.microkernel`): a key the query cannot see (causal, window, custom mask, past its
    row's end) never changes its answer, whatever it holds; a visible score of NaN or ``+inf`` makes ``out``
    and ``lse`` NaN, a score of ``-inf`` weighs 0; a NaN or infinity in a visible key's ``v`` makes the whole
    ``out`` row NaN (``lse`` unchanged). A NaN reaches only the rows that see it and is never reported as an
    empty row.

    Examples
    --------
    >>> import numpy as np, bsrattn as ba
    >>> rng = np.random.default_rng(0)
    >>> layout = ba.layouts.paged([1, 2], [[2, 0], [1]], kv_lens=[20, 7], page_size=16, num_pages=3)
    >>> q = rng.standard_normal((3, 4, 8)); k, v = rng.standard_normal((2, 3, 16, 2, 8))
    >>> out, lse = ba.attention(q, k, v, layout, variant=ba.Variant(causal=True), return_lse=True)
    >>> out.shape, lse.shape
    ((3, 4, 8), (3, 4))
    """
    be = get_backend(backend)
    variant = _PLAIN if variant is None else variant
    run_kwargs = dict(return_lse=return_lse, k_scale=k_scale, v_scale=v_scale)
    split = check_deterministic(deterministic, split_size)
    if split is not None:  # planned like any BatchAttention step, on the chunk grid
        first = _levels(layout)[0]
        spec = spec_from_inputs(q, k, v, first, _level_variant(layout, 0, variant), kv_layout, out=out, lse=lse,
                                **run_kwargs)
        attn = BatchAttention(be)
        attn.plan(layout, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, variant=variant, q_dtype=spec.q_dtype,
                  kv_dtype=spec.kv_dtype, kv_layout=kv_layout, rope_positions=rope_positions, deterministic=True,
                  split_size=split)
        return attn.run(q, k, v, out=out, lse=lse, **run_kwargs)
    if isinstance(layout, BSRLayout):
        spec = _one_shot_spec(q, k, v, layout, variant, kv_layout, out, lse, run_kwargs, rope_positions)
        if variant.sinks is None:
            o, s = be.attention(spec, q, k, v, out=out, lse=lse, **run_kwargs)
            return (o, s) if return_lse else o
        specs = [spec]  # one level, then the sinks (_merge_levels)
    else:
        specs = [_positioned(layout, i, spec_from_inputs(q, k, v, level, _level_variant(layout, i, variant),
                                                         kv_layout, out=out, lse=lse, **run_kwargs), rope_positions)
                 for i, level in enumerate(_levels(layout))]
    o, s = _merge_levels(be, lambda i, **kw: be.attention(specs[i], q, k, v, k_scale=k_scale, v_scale=v_scale, **kw),
                         len(specs), variant, out, lse, return_lse)
    return (o, s) if return_lse else o


_last_one_shot = None
"""``(layout, (variant, kv_layout, run key), spec)`` of the last one-shot call of a BSRLayout that passed the
checks, the run key as :func:`_run_key` gives it."""


def _one_shot_spec(q, k, v, layout, variant, kv_layout, out, lse, run_kwargs, rope_positions):
    """The checked spec of a one-shot call over a BSRLayout. The checks read only the layout (immutable), the
    variant, ``kv_layout`` and what the run key holds of the arguments (as :meth:`BatchAttention.run`'s do), so
    a call with the last passing call's layout object, variant, view and key gets its spec without them: a
    model's layers call with one layout in a step. With ``rope_positions`` (arrays of the caller's) the checks
    always run."""
    global _last_one_shot
    key = None
    if rope_positions is None:
        key = _run_key(q, k, v, out, lse, run_kwargs["return_lse"], run_kwargs["k_scale"], run_kwargs["v_scale"])
        last = _last_one_shot
        if key is not None and last is not None and last[0] is layout and last[1] == (variant, kv_layout, key):
            return last[2]
    spec = _positioned(layout, 0, spec_from_inputs(q, k, v, layout, variant, kv_layout, out=out, lse=lse,
                                                   **run_kwargs), rope_positions)
    if key is not None:
        _last_one_shot = (layout, (variant, kv_layout, key), spec)
    return spec


class BatchAttention:
    """Plan once per step (host), run once per layer (device): FlashInfer's inspector-executor split.

    Parameters
    ----------
    backend : str or Backend, optional
        The tier that plans and runs, ``"reference"``, ``"numba"``, ``"torch"`` or ``"auto"``; default: the
        flag's choice when the object is made (see :mod:`bsrattn.backends`).

    Raises
    ------
    ValueError
        An unknown backend name.
    BackendError
        A backend whose dependency is not installed.

    Examples
    --------
    >>> import numpy as np, bsrattn as ba
    >>> layout = ba.layouts.ragged([1, 1], [40, 9])
    >>> attn = ba.BatchAttention(backend="reference")
    >>> attn.plan(layout, num_qo_heads=4, num_kv_heads=2, head_dim=8, num_ctas=4)
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((2, 4, 8)), rng.standard_normal((49, 2, 8)), rng.standard_normal((49, 2, 8))
    >>> np.allclose(attn.run(q, k, v), ba.attention(q, k, v, layout))
    True
    """

    def __init__(self, backend: str | Backend | None = None) -> None:
        self.backend = get_backend(backend)
        self._args: tuple = ()
        self._specs: list = []
        self._checks: list = []  # the specs run checks its arguments against (a flattened Cascade's: its levels')
        self._slots_of: str | None = None  # a flattened Cascade's kv_layout: run views its pool one slot per row
        self._runners: list = []
        self._sink_rows: dict = {}  # the sinks' state, kept between calls (state.merge_sinks)
        self._passed: tuple | None = None  # the last run's _run_key, when its arguments passed the checks
        self._call = None  # run's work for arguments of that key (_bind)

    def plan(self, layout: BSRLayout | Cascade, num_qo_heads: int, num_kv_heads: int, head_dim: int, *,
             variant: Variant | None = None, q_dtype: DType | None = None, kv_dtype: DType | None = None,
             kv_layout: str = "NHD", num_ctas: int | None = None, fixed_split_size: int | None = None,
             disable_split_kv: bool = False, rope_positions: tuple | None = None, deterministic: bool = False,
             split_size: int | None = None) -> None:
        """Compute the :class:`~bsrattn.scheduler.WorkPlan` for ``layout`` and bind it to this object.

        ``num_ctas`` counts CTAs **per KV head**, not in all: every KV head runs the same plan on its own
        ``num_ctas`` CTAs, so a launch is ``num_ctas x num_kv_heads`` CTAs. The default is the tier's (one wave
        of the GPU, with the tier's minimum chunk and chunk alignment); a given ``num_ctas`` plans Algorithm 1
        exactly at that count, with chunks of ``L_kv`` slots. ``fixed_split_size`` fixes the KV chunk size (batch
        invariance); ``disable_split_kv`` gives each query tile one item.
        Calling ``plan`` again refills the tier's buffers in place where it can (CUDA-graph replay).

        ``deterministic=True`` makes the result partition-invariant: a query row's ``out`` and ``lse`` are bitwise
        identical whatever else the call holds and however the work is cut — the batch and its size, ``num_ctas``,
        a re-plan or a fresh object, eager or a replayed CUDA graph, flat KV or a Cascade, a decode step or the
        same query as a row of a causal prefill over the same keys, one call or KV pieces merged with
        :func:`merge_state` (in KV order, each piece after the first within one chunk of the grid, the states in
        float32). Each row's KV is cut on a grid fixed at absolute positions, every ``split_size`` slots; each
        chunk's state is computed alone, with arithmetic whose bits do not depend on the tile the row sits in;
        the chunks' states are folded left to right with ⊕. A Cascade runs as its flattened layout
        (:meth:`Cascade.flatten`: each query's keys of every level in order), so the grid runs through its
        levels; each request then reads the shared prefix itself, as in flat KV. A row that ``rope_positions``
        starts off the grid is refused. The bits are each tier's own: tiers agree with each other to rounding.

        Ints (heads, ``head_dim``, ``num_ctas``, ``fixed_split_size``) may be NumPy integers but not floats or
        bools; ``q_dtype``/``kv_dtype`` may be names, torch dtypes or NumPy dtypes. ``num_ctas`` is at most
        ``bsrattn.scheduler.MAX_CTAS`` (2**20).

        Parameters
        ----------
        layout : BSRLayout or Cascade
            The step's layout; a Cascade gets one plan per level.
        num_qo_heads, num_kv_heads : int
            Query and KV heads (``num_qo_heads % num_kv_heads == 0``).
        head_dim : int
            The head dimension of ``q``, ``k`` and ``v``.
        variant : Variant, optional
            How scores become weights; default ``Variant()``.
        q_dtype, kv_dtype : str or dtype, optional
            The dtypes ``run`` must then be given; None leaves that dtype free (any supported one).
        kv_layout : {"NHD", "HND"}
            The storage order of ``k`` and ``v`` (see :func:`attention`).
        num_ctas : int, optional
            CTAs per KV head; default: the tier's.
        fixed_split_size : int, optional
            KV slots per chunk instead of Algorithm 1's ``L_kv`` (batch invariance).
        disable_split_kv : bool
            One work item per query tile over its whole KV.
        rope_positions : pair of int arrays, optional
            Fused RoPE's positions of a BSRLayout's queries and rows' first slots, as :func:`attention` takes
            them; a step's positions, so given again at each ``plan``.
        deterministic : bool
            Partition-invariant mode (above).
        split_size : int, optional
            Deterministic mode's chunk grid: KV slots per chunk, a multiple of 64; default
            ``bsrattn.validation.DEFAULT_SPLIT_SIZE`` (1024). Only with ``deterministic=True``.

        Returns
        -------
        None
            The plan is bound to this object (see :attr:`work_plans`).

        Raises
        ------
        TypeError
            ``layout`` not a BSRLayout or a Cascade, an int argument that is a float or a bool, a dtype that is
            not supported.
        ValueError
            A head count, ``head_dim`` or option out of range, ``num_qo_heads`` not a multiple of
            ``num_kv_heads``, a variant that does not fit the layout or the heads, ``rope_positions`` that do
            not fit the layout or come without fused RoPE; in deterministic mode a ``split_size`` that is not a
            multiple of 64, ``fixed_split_size`` or ``disable_split_kv`` beside it, a row that ``rope_positions``
            starts off the grid, a Cascade that cannot be flattened.
        """
        variant = _PLAIN if variant is None else variant
        split = check_deterministic(deterministic, split_size, fixed_split_size, disable_split_kv)
        levels = _levels(layout)
        checks = []
        slots_of = None
        if split is not None:
            if isinstance(layout, Cascade):  # run checks k and v as the levels' pool, then views it per slot
                checks = [make_spec(level, num_qo_heads, num_kv_heads, head_dim, _level_variant(layout, i, variant),
                                    q_dtype, kv_dtype, kv_layout) for i, level in enumerate(levels)]
                slots_of, kv_layout = kv_layout, "NHD"
            layout = _deterministic_layout(layout, rope_positions)
            levels = (layout,)
        args = (num_qo_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, kv_layout)
        # The very objects the previous step passed were checked then (identity, not equality: 4.0 == 4).
        same = bool(self._args) and all(map(operator.is_, args, self._args))
        specs, runners = [], []
        for i, level in enumerate(levels):
            level_variant = _level_variant(layout, i, variant)
            previous_spec = self._specs[i] if same and i < len(self._specs) else None
            # A level is a BSRLayout (see _levels).
            if previous_spec is not None and _reusable(previous_spec, level_variant):
                spec = AttentionSpec(level, *_spec_args(previous_spec))
            else:
                spec = make_spec(level, num_qo_heads, num_kv_heads, head_dim, level_variant, q_dtype, kv_dtype,
                                 kv_layout)
            spec = _positioned(layout, i, spec, rope_positions)
            if spec.split_size != split:
                spec = replace(spec, split_size=split)
            if split is not None and spec.rope_positions is not None:
                check_on_grid(spec.rope_positions[1], split, "rope_positions[1] (kv_offsets)")
            options = dict(self.backend.plan_options(spec))
            if num_ctas is not None:
                options.update(num_ctas=num_ctas, min_split_size=1, kv_align=1, busy_ctas=num_ctas)
            # A layout's lengths were checked when it was built: only the options are checked here.
            work_plan = scheduler._plan_valid(level.qo_lens, level.kv_lens,
                                              fixed_split_size=fixed_split_size if split is None else split,
                                              disable_split_kv=disable_split_kv, **options)
            previous = self._runners[i] if i < len(self._runners) else None
            runners.append(self.backend.make_runner(spec, work_plan, previous=previous))
            specs.append(spec)
        self._args, self._specs, self._runners = args, specs, runners
        self._checks, self._slots_of = checks or specs, slots_of
        self._passed = None

    @property
    def work_plans(self) -> list[WorkPlan]:
        """The current plan of each level (one for a plain layout)."""
        return [r.work_plan for r in self._runners]

    def run(self, q: Array, k: Array, v: Array, *, out: Array | None = None, lse: Array | None = None,
            return_lse: bool = False, k_scale: float | None = None,
            v_scale: float | None = None) -> Array | tuple[Array, Array]:
        """Execute the plan on ``q``, ``k``, ``v`` (shapes as in :func:`attention`); may be called many times.

        NaN and infinities follow :func:`attention`'s rules, however the plan splits the rows. The arguments are
        checked against the plan unless they match the last call that passed in all the checks read (each
        array's type, shape, dtype, device and writability, ``return_lse``, the scales). Each call is
        self-contained: it depends on nothing an earlier call left in the plan's buffers, whether that call
        finished, overlapped or stopped part-way. Calls from several Python threads or CUDA streams take
        turns over the buffers, so each gets its own answer; the replays of a captured CUDA graph are
        ordered by whoever replays them.

        Parameters
        ----------
        q : array, ``[nnz_qo, num_qo_heads, head_dim]``
            The queries, of the planned ``q_dtype``.
        k, v : arrays
            The KV pool, ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD) or as planned
            ``kv_layout`` says, of the planned ``kv_dtype``.
        out, lse : arrays, optional
            Buffers to write into: ``out`` like ``q``, ``lse [nnz_qo, num_qo_heads]`` float32.
        return_lse : bool
            Also return ``lse``, float32, natural log.
        k_scale, v_scale : float, optional
            Scales of the stored K and V, of any KV dtype (fp8's dequantisation scales): scores are
            taken with ``k * k_scale`` and outputs made of ``v * v_scale``. None: 1.

        Returns
        -------
        out or (out, lse)
            As :func:`attention` returns them.

        Raises
        ------
        RuntimeError
            ``run`` called before :meth:`plan`.
        TypeError, ValueError
            Tensors that do not match the plan (shapes, dtypes, devices), as :func:`attention` raises them.
        """
        if not self._runners:
            raise RuntimeError("BatchAttention.run called before plan()")
        # A serving loop calls run with the same buffers again and again: the checks read only what the key
        # holds, so arguments with the last passing call's key pass them too.
        key = _run_key(q, k, v, out, lse, return_lse, k_scale, v_scale)
        if key is None or key != self._passed:
            run_kwargs = dict(k_scale=k_scale, v_scale=v_scale)
            for spec in self._checks:
                spec.check_run(q, k, v, out=out, lse=lse, return_lse=return_lse, **run_kwargs)
            self._passed = key
            self._call = self._bind(q, k, v, out, lse, return_lse, run_kwargs)
        return self._call(q, k, v, out, lse)

    def _bind(self, q, k, v, out, lse, return_lse, run_kwargs):
        """``call(q, k, v, out, lse)``: :meth:`run` with these keyword arguments, for arguments of these kinds (what
        the check key holds). A plain layout's runner that can bind a call (``Runner.bind``: the torch tier) does
        the work that follows from the kinds once, here; the rest run the whole call each time."""
        variant = self._specs[-1].variant
        runner = self._runners[0]
        single = len(self._runners) == 1 and variant.sinks is None
        if single and self._slots_of is None and hasattr(runner, "bind"):
            call = runner.bind(q, k, v, out=out, lse=lse, return_lse=return_lse, **run_kwargs)
            if return_lse:
                return call
            return lambda q, k, v, out, lse: call(q, k, v, out, lse)[0]

        def general(q, k, v, out, lse):
            if self._slots_of is not None:
                k, v = _slot_view(k, self._slots_of), _slot_view(v, self._slots_of)
            if single:
                o, s = runner.run(q, k, v, out=out, lse=lse, return_lse=return_lse, **run_kwargs)
                return (o, s) if return_lse else o
            o, s = _merge_levels(self.backend, lambda i, **kw: self._runners[i].run(q, k, v, **kw, **run_kwargs),
                                 len(self._runners), variant, out, lse, return_lse, self._sink_rows)
            return (o, s) if return_lse else o

        return general


def _run_key(q, k, v, out, lse, return_lse, k_scale, v_scale) -> tuple | None:
    """What :meth:`AttentionSpec.check_run` reads of ``run``'s arguments: each array's type, shape, dtype and
    device (and a NumPy buffer's writability), the flag and the scales with their types (``True`` equals 1 but
    is refused as a scale); None when an argument is not an array."""
    try:
        return (_array_key(q), _array_key(k), _array_key(v), _array_key(out), _array_key(lse), return_lse,
                type(k_scale), k_scale, type(v_scale), v_scale)
    except AttributeError:  # not an array: the checks say what it is
        return None


def _array_key(x) -> tuple | None:
    if x is None:
        return None
    return type(x), x.shape, x.dtype, getattr(x, "device", None), getattr(x, "flags", _WRITABLE).writeable


class _Writable:
    writeable = True


_WRITABLE = _Writable()  # the flags of an array that has none (a torch tensor): writable


def _check_floats(**states):
    """Raise unless each of ``states`` is an array of real floats (not ints, bools or complex numbers)."""
    for name, x in states.items():
        check_array(name, x)
        if dtype_name(x) not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {dtype_name(x)}; attention states are real floats of one of the "
                            f"dtypes {FLOAT_DTYPES}")


def _check_state(name_o, o, name_lse, lse):
    if len(shape_of(o)) < 2 or shape_of(lse) != shape_of(o)[:-1]:
        raise ValueError(f"{name_o} has shape {shape_of(o)} and {name_lse} {shape_of(lse)}: "
                         f"need {name_o} [..., H, D] and {name_lse} [..., H]")


def merge_state(o_a: Array, lse_a: Array, o_b: Array, lse_b: Array, *,
                backend: str | Backend | None = None) -> tuple[Array, Array]:
    """The ⊕ operator: merge two attention states over disjoint keys. See :mod:`bsrattn.reference.merge`.

    ``o_a``, ``o_b`` ``[..., H, D]`` and ``lse_a``, ``lse_b`` ``[..., H]`` are arrays of real floats (float64,
    float32, float16, bfloat16); anything else, an integer, bool or complex array included, raises
    ``TypeError`` naming it, before any tier is called.

    An empty state (``lse = -inf``) is the identity whatever its ``o`` holds, NaN included; an ``lse`` of NaN
    or ``+inf`` in either state gives NaN ``o`` and ``lse``; a NaN in a non-empty state's ``o`` reaches the
    result. The same on every tier.

    Parameters
    ----------
    o_a, o_b : arrays, ``[..., H, D]``
        The two states' outputs, of one shape.
    lse_a, lse_b : arrays, ``[..., H]``
        Their log-sum-exps, natural log.
    backend : str or Backend, optional
        The tier that merges; default: the flag (see :mod:`bsrattn.backends`).

    Returns
    -------
    (o, lse)
        The merged state: ``o [..., H, D]``, ``lse [..., H]``, of the inputs' array kind.

    Raises
    ------
    TypeError
        An input that is not an array of real floats.
    ValueError
        ``lse_a``/``lse_b`` not ``o_a``/``o_b``'s shape without its last axis, or ``o_a`` and ``o_b`` of
        different shapes.

    Examples
    --------
    >>> import numpy as np, bsrattn as ba
    >>> o, s = ba.merge_state(np.ones((1, 1, 2)), np.zeros((1, 1)), 3 * np.ones((1, 1, 2)), np.zeros((1, 1)))
    >>> o.tolist(), np.round(s, 4).tolist()
    ([[[2.0, 2.0]]], [[0.6931]])
    """
    _check_floats(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)
    _check_state("o_a", o_a, "lse_a", lse_a)
    _check_state("o_b", o_b, "lse_b", lse_b)
    if shape_of(o_a) != shape_of(o_b):
        raise ValueError(f"o_a {shape_of(o_a)} and o_b {shape_of(o_b)} must have the same shape")
    return get_backend(backend).merge_state(o_a, lse_a, o_b, lse_b)


def merge_states(o: Array, lse: Array, *, backend: str | Backend | None = None) -> tuple[Array, Array]:
    """Fold ``o [n, S, H, D]``, ``lse [n, S, H]`` over ``S`` in index order. See :mod:`bsrattn.reference.merge`.

    The fold is ``((s_0 ⊕ s_1) ⊕ s_2) ⊕ …``, always in that order, on every tier (see :func:`merge_state`).
    ``o`` and ``lse`` must be arrays of real floats, as in :func:`merge_state`.

    Parameters
    ----------
    o : array, ``[n, S, H, D]``
        ``S`` states' outputs for each of ``n`` rows.
    lse : array, ``[n, S, H]``
        Their log-sum-exps, natural log.
    backend : str or Backend, optional
        The tier that merges; default: the flag (see :mod:`bsrattn.backends`).

    Returns
    -------
    (o, lse)
        The folded state: ``o [n, H, D]``, ``lse [n, H]``.

    Raises
    ------
    TypeError
        ``o`` or ``lse`` not an array of real floats.
    ValueError
        Shapes other than ``[n, S, H, D]`` and ``[n, S, H]``, or ``S == 0``.

    Examples
    --------
    >>> import numpy as np, bsrattn as ba
    >>> o = np.stack([np.full((1, 1, 2), x) for x in (1.0, 2.0, 6.0)], axis=1)   # [n=1, S=3, H=1, D=2]
    >>> out, lse = ba.merge_states(o, np.zeros((1, 3, 1)))                        # three equal-weight states
    >>> out.tolist(), bool(np.isclose(lse[0, 0], np.log(3)))
    ([[[3.0, 3.0]]], True)
    """
    _check_floats(o=o, lse=lse)
    if len(shape_of(o)) != 4 or shape_of(lse) != shape_of(o)[:3]:
        raise ValueError(f"merge_states needs o [n, S, H, D] and lse [n, S, H]; got {shape_of(o)} and {shape_of(lse)}")
    if shape_of(o)[1] == 0:
        raise ValueError("merge_states needs at least one state (S >= 1)")
    return get_backend(backend).merge_states(o, lse)
