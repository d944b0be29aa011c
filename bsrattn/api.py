"""The public entry points, each routed through the backend flag: one call, three tiers."""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import TYPE_CHECKING

from bsrattn import scheduler
from bsrattn._types import Array, DType
from bsrattn.backends import Backend, get_backend
from bsrattn.cascade import Cascade
from bsrattn.layout import BSRLayout
from bsrattn.passed import ONE_SHOT, Passed, run_key, spec_like
from bsrattn.state import merge_sinks, write_into
from bsrattn.validation import check_deterministic, check_on_grid, check_rope_positions, make_spec, shape_of, \
    spec_from_inputs
from bsrattn.variant import Variant

if TYPE_CHECKING:
    from bsrattn.scheduler import WorkPlan

__all__ = ["attention", "BatchAttention"]

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


def _deterministic_layout(layout, variant, rope_positions):
    """The layout a deterministic plan runs: a BSRLayout itself; a Cascade as its one flattened layout, each
    query's keys of every level in order, so that the chunk grid runs through the levels as through flat KV."""
    if not isinstance(layout, Cascade):
        return layout
    if rope_positions is not None:
        raise ValueError("rope_positions is for a BSRLayout: a Cascade's levels turn at their positions in the "
                         "whole sequence (Cascade.rope_positions)")
    return layout.flatten(causal=variant.causal)


def attention(q: Array, k: Array, v: Array, layout: BSRLayout | Cascade, *, variant: Variant | None = None,
              backend: str | Backend | None = None, kv_layout: str = "NHD", return_lse: bool = False,
              out: Array | None = None, lse: Array | None = None, k_scale: float | None = None,
              v_scale: float | None = None, rope_positions: tuple | None = None, deterministic: bool = False,
              split_size: int | None = None, kernel: str | None = None) -> Array | tuple[Array, Array]:
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
    kernel : {"shipped", "core"}, optional
        Which of the tier's kernels runs: ``"shipped"`` (the default), or ``"core"``, the paper's kernel at teaching
        size (the numba and torch tiers; see :data:`bsrattn.backends.KERNELS`). The core has no chunk grid, so
        not with ``deterministic=True``.

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
        ``split_size`` that is not a multiple of 64 or a row that ``rope_positions`` starts off the chunk grid;
        a ``kernel`` the tier does not run, or ``kernel="core"`` with ``deterministic=True``.

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
    be = get_backend(backend, kernel)
    variant = _PLAIN if variant is None else variant
    run_kwargs = dict(return_lse=return_lse, k_scale=k_scale, v_scale=v_scale)
    split = _check_kernel_mode(be, check_deterministic(deterministic, split_size))
    if split is not None:  # planned like any BatchAttention step, on the chunk grid
        first = _levels(layout)[0]
        spec = spec_from_inputs(q, k, v, first, _level_variant(layout, 0, variant), kv_layout, out=out, lse=lse,
                                **run_kwargs)
        attn = BatchAttention(be)
        attn.plan(layout, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, variant=variant, q_dtype=spec.q_dtype,
                  kv_dtype=spec.kv_dtype, kv_layout=kv_layout, rope_positions=rope_positions, deterministic=True,
                  split_size=split, head_dim_vo=spec.head_dim_vo)
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


def _check_kernel_mode(backend, split):
    """``split`` (deterministic mode's chunk grid, or None), refused for a kernel that has no chunk grid."""
    if split is not None and backend.kernel == "core":
        raise ValueError(f"deterministic=True: the {backend.name!r} tier's core kernel has no chunk grid; run "
                         f"deterministic mode on the shipped kernel (kernel=None)")
    return split


def _one_shot_spec(q, k, v, layout, variant, kv_layout, out, lse, run_kwargs, rope_positions):
    """The checked spec of a one-shot call over a BSRLayout; a call like the last that passed (its layout object,
    variant, view and run key: :mod:`bsrattn.passed`) gets it without the checks: a model's layers call with one
    layout in a step. With ``rope_positions`` (arrays of the caller's) the checks always run."""
    def check():
        return _positioned(layout, 0, spec_from_inputs(q, k, v, layout, variant, kv_layout, out=out, lse=lse,
                                                       **run_kwargs), rope_positions)

    if rope_positions is not None:
        return check()
    key = run_key(q, k, v, out, lse, run_kwargs["return_lse"], run_kwargs["k_scale"], run_kwargs["v_scale"])
    return ONE_SHOT.get(None if key is None else (_Identity(layout), variant, kv_layout, key), check)


class _Identity:
    """A layout compared by identity, not equality: a key holds the very object that passed."""

    __slots__ = ("obj",)

    def __init__(self, obj) -> None:
        self.obj = obj

    def __eq__(self, other) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj

    __hash__ = None


class BatchAttention:
    """Plan once per step (host), run once per layer (device): FlashInfer's inspector-executor split.

    Parameters
    ----------
    backend : str or Backend, optional
        The tier that plans and runs, ``"reference"``, ``"numba"``, ``"torch"`` or ``"auto"``; default: the
        flag's choice when the object is made (see :mod:`bsrattn.backends`).
    kernel : {"shipped", "core"}, optional
        Which of the tier's kernels runs (see :func:`attention`); default ``"shipped"``.
    cuda_graph : bool
        Launch, for every plan, the kernel that runs any plan of the tier's persistent buffers (on the torch tier:
        the persistent kernel with split rows' merges, where a plan that splits nothing would take a lighter one),
        so that a CUDA graph captured around :meth:`run` replays every later plan while :attr:`graph_key` stays
        the same, as FlashInfer's ``use_cuda_graph`` wrappers keep one kernel; a little slower where the lighter
        kernel would have run. Tiers without persistent buffers ignore it.

    Raises
    ------
    ValueError
        An unknown backend name, or a ``kernel`` the tier does not run.
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

    def __init__(self, backend: str | Backend | None = None, kernel: str | None = None,
                 cuda_graph: bool = False) -> None:
        self.backend = get_backend(backend, kernel)
        if not isinstance(cuda_graph, bool):
            raise TypeError(f"cuda_graph must be a bool, got {cuda_graph!r}")
        self.cuda_graph = cuda_graph
        self._args: tuple = ()
        self._specs: list = []
        self._checks: list = []  # the specs run checks its arguments against (a flattened Cascade's: its levels')
        self._slots_of: str | None = None  # a flattened Cascade's kv_layout: run views its pool one slot per row
        self._runners: list = []
        self._sink_rows: dict = {}  # the sinks' state, kept between calls (state.merge_sinks)
        self._passed = Passed()  # run's work for arguments like the last that passed the checks (_bind)

    def plan(self, layout: BSRLayout | Cascade, num_qo_heads: int, num_kv_heads: int, head_dim: int, *,
             variant: Variant | None = None, q_dtype: DType | None = None, kv_dtype: DType | None = None,
             kv_layout: str = "NHD", num_ctas: int | None = None, fixed_split_size: int | None = None,
             disable_split_kv: bool = False, rope_positions: tuple | None = None, deterministic: bool = False,
             split_size: int | None = None, head_dim_vo: int | None = None) -> None:
        """Compute the :class:`~bsrattn.scheduler.WorkPlan` for ``layout`` and bind it to this object.

        ``num_ctas`` counts CTAs **per KV head**, not in all: every KV head runs the same plan on its own
        ``num_ctas`` CTAs, so a launch is ``num_ctas x num_kv_heads`` CTAs (on the GPU tiers, times the head groups a
        KV head's query heads run in where they overflow one tile: MLA's 128 heads). The default is the tier's (one
        wave of the GPU, with the tier's minimum chunk and chunk alignment); a given ``num_ctas`` plans Algorithm 1
        exactly at that count, with chunks of ``L_kv`` slots. ``fixed_split_size`` fixes the KV chunk size (batch
        invariance); ``disable_split_kv`` gives each query tile one item.
        Calling ``plan`` again refills the tier's buffers in place where it can (CUDA-graph replay).

        ``deterministic=True`` makes the result partition-invariant: a query row's ``out`` and ``lse`` are bitwise
        identical whatever else the call holds and however the work is cut — the batch and its size, ``num_ctas``,
        a re-plan or a fresh object, eager or a replayed CUDA graph, flat KV or a Cascade, a decode step or the
        same query as a row of a causal prefill over the same keys, one call or KV pieces merged with
        :func:`merge_state` (in KV order, each piece after the first within one chunk of the grid, the states in
        float32; on the reference tier, whose chunk states and fold are float64 inside, in float64 — a float64
        ``q`` — while float32 pieces there match the one call to float32 rounding). Each row's KV is cut on a
        grid fixed at absolute positions, every ``split_size`` slots; each chunk's state is computed alone, with
        arithmetic whose bits do not depend on the tile the row sits in; the chunks' states are folded left to
        right with ⊕. A Cascade runs as its flattened layout
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
            The head dimension of ``q`` and ``k`` (and of ``v`` and ``out``, unless ``head_dim_vo`` says otherwise).
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
        head_dim_vo : int, optional
            The head dimension of ``v`` and ``out`` where it is not ``head_dim`` (FlashInfer's ``head_dim_vo``:
            multi-head latent attention, :mod:`bsrattn.mla`, or a prefill of 192-wide keys and 128-wide values);
            on the tiers whose kernels take it (:attr:`~bsrattn.backends.Backend.head_dim_vo`). Not with fused
            RoPE.

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
        split = _check_kernel_mode(self.backend,
                                   check_deterministic(deterministic, split_size, fixed_split_size, disable_split_kv))
        levels = _levels(layout)
        checks = []
        slots_of = None
        if split is not None:
            if isinstance(layout, Cascade):  # run checks k and v as the levels' pool, then views it per slot
                checks = [make_spec(level, num_qo_heads, num_kv_heads, head_dim, _level_variant(layout, i, variant),
                                    q_dtype, kv_dtype, kv_layout, head_dim_vo) for i, level in enumerate(levels)]
                slots_of, kv_layout = kv_layout, "NHD"
            layout = _deterministic_layout(layout, variant, rope_positions)
            levels = (layout,)
        args = (num_qo_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, kv_layout, head_dim_vo)
        # The very objects the previous step passed were checked then (identity, not equality: 4.0 == 4).
        same = bool(self._args) and all(map(operator.is_, args, self._args))
        specs, runners = [], []
        for i, level in enumerate(levels):
            level_variant = _level_variant(layout, i, variant)
            previous_spec = self._specs[i] if same and i < len(self._specs) else None
            # A level is a BSRLayout (see _levels).
            spec = None if previous_spec is None else spec_like(previous_spec, level, level_variant)
            if spec is None:
                spec = make_spec(level, num_qo_heads, num_kv_heads, head_dim, level_variant, q_dtype, kv_dtype,
                                 kv_layout, head_dim_vo)
            spec = _positioned(layout, i, spec, rope_positions)
            if (spec.split_size, spec.cuda_graph) != (split, self.cuda_graph):
                spec = replace(spec, split_size=split, cuda_graph=self.cuda_graph)
            if split is not None and spec.rope_positions is not None:
                check_on_grid(spec.rope_positions[1], split, "rope_positions[1] (kv_offsets)")
            options = dict(self.backend.plan_options(spec))
            if num_ctas is not None:
                options.update(num_ctas=num_ctas, min_split_size=1, kv_align=1, busy_ctas=num_ctas)
            # A layout's lengths were checked when it was built: only the options are checked here.
            work_plan = scheduler.plan_layout(level, fixed_split_size=fixed_split_size if split is None else split,
                                              disable_split_kv=disable_split_kv, **options)
            previous = self._runners[i] if i < len(self._runners) else None
            runners.append(self.backend.make_runner(spec, work_plan, previous=previous))
            specs.append(spec)
        self._args, self._specs, self._runners = args, specs, runners
        self._checks, self._slots_of = checks or specs, slots_of
        self._passed.forget()

    @property
    def work_plans(self) -> list[WorkPlan]:
        """The current plan of each level (one for a plain layout)."""
        return [r.work_plan for r in self._runners]

    @property
    def graph_key(self) -> tuple | None:
        """What a CUDA graph captured around :meth:`run` records beyond the contents of the plan's buffers: equal
        before and after a :meth:`plan`, the graph replays the new plan (with ``cuda_graph=True``; without it, a
        re-plan may also switch kernels, and the tier warns). None on a tier whose runs no graph can replay
        (the reference and numba tiers, the core kernels: they keep no persistent buffers)."""
        keys = [getattr(r, "graph_key", None) for r in self._runners]
        return None if not keys or None in keys else tuple(key() for key in keys)

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
        run_kwargs = dict(k_scale=k_scale, v_scale=v_scale)

        def check():
            for spec in self._checks:
                spec.check_run(q, k, v, out=out, lse=lse, return_lse=return_lse, **run_kwargs)
            return self._bind(q, k, v, out, lse, return_lse, run_kwargs)

        call = self._passed.get(run_key(q, k, v, out, lse, return_lse, k_scale, v_scale), check)
        return call(q, k, v, out, lse)

    def _bind(self, q, k, v, out, lse, return_lse, run_kwargs):
        """``call(q, k, v, out, lse)``: :meth:`run` with these keyword arguments, for arguments of these kinds (what
        the check key holds). A plain layout's runner that can bind a call (:attr:`Backend.binds_runs`: the torch
        tier's shipped kernel) does the work that follows from the kinds once, here; the rest run the whole call
        each time."""
        variant = self._specs[-1].variant
        runner = self._runners[0]
        single = len(self._runners) == 1 and variant.sinks is None
        if single and self._slots_of is None and self.backend.binds_runs:
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
