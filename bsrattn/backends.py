"""The backend registry and the flag that picks a tier.

A backend is a module implementing execution: the functions named in :data:`TIER_FUNCTIONS`, called through
:class:`Backend`. The registry is an explicit dict of name -> module path, imported lazily: importing
:mod:`bsrattn` imports neither numba, torch nor triton. Which backend a call uses, first match wins:

1. its ``backend=`` argument (a name or a :class:`Backend`);
2. the innermost ``with bsrattn.use_backend(name):`` block;
3. ``bsrattn.set_backend(name)``;
4. the environment variable ``BSRATTN_BACKEND``;
5. ``"reference"``.

``"auto"`` means the torch tier when a CUDA GPU and Triton are present, else the reference.

A GPU tier runs one of two kernels (``kernel=``, see :data:`KERNELS`): ``"shipped"``, its serving kernels, or
``"core"``, the paper's kernel at teaching size (the tier's ``core`` module), held to the same tests.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.util
import os
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

from bsrattn._types import Array

if TYPE_CHECKING:
    from bsrattn.scheduler import WorkPlan
    from bsrattn.validation import AttentionSpec

REGISTRY = {
    "reference": "bsrattn.reference",
    "numba": "bsrattn.numba_cuda",
    "torch": "bsrattn.torch_cuda",
}

_REQUIREMENTS = {
    "numba": (("numba", "numba.cuda"), "pip install 'bsrattn[numba]'"),
    "torch": (("torch", "triton"), "pip install 'bsrattn[torch]'"),
}

_global: str | None = None
_scoped: contextvars.ContextVar = contextvars.ContextVar("bsrattn_backend", default=None)
_loaded: dict = {}


class BackendError(RuntimeError):
    """A backend that cannot load here: its dependency is missing. The message names the install command.

    An unknown backend name raises ``ValueError`` instead.

    Examples
    --------
    >>> import bsrattn as ba
    >>> issubclass(ba.BackendError, RuntimeError)
    True
    """


TIER_FUNCTIONS = ("attention", "merge_state", "merge_states", "add_states", "plan_options", "make_runner")
"""What a tier's module provides: the functions :class:`Backend` calls, and nothing else of the module."""

KERNEL_FUNCTIONS = ("attention", "plan_options", "make_runner")
"""What a tier's ``core`` module provides: the functions that run a kernel (the merges stay the tier's)."""

TIER_FLAGS = {"FOLDS_PRIOR": False, "BINDS_RUNS": False, "HEAD_DIM_VO": False, "KERNELS": ("shipped",)}
"""What a tier module may declare of itself, with the default for a module that declares nothing; read and
checked once, when the tier loads:

- ``FOLDS_PRIOR`` (bool): its ``attention`` and runners' ``run`` take ``prior=(o, lse)``, a state of the same
  query rows folded in by the kernel before it writes (a Cascade's earlier levels, :mod:`bsrattn.api`);
- ``BINDS_RUNS`` (bool): its runners have ``bind(q, k, v, *, out, lse, return_lse, k_scale, v_scale) ->
  call(q, k, v, out, lse)``, the work that follows from the arguments' kinds done once for a serving loop;
- ``HEAD_DIM_VO`` (bool): its kernels take ``v`` and ``out`` of another head dimension than ``q`` and ``k``
  (``AttentionSpec.head_dim_vo``: multi-head latent attention, :mod:`bsrattn.mla`); a ``core`` module declares
  its own;
- ``KERNELS`` (tuple): the kernels it runs, of :data:`KERNELS`; ``"core"`` means it has a ``core`` module
  providing :data:`KERNEL_FUNCTIONS`, which neither folds a prior state nor binds runs."""

KERNELS = ("shipped", "core")
"""The kernels a tier may run: ``"shipped"`` (the default), its serving kernels; ``"core"``, the paper's kernel at
teaching size (``numba_cuda/core.py``, ``torch_cuda/core.py``)."""


class Backend:
    """A named tier: a handle on its module, which must provide each of :data:`TIER_FUNCTIONS`.

    The methods below are the whole interface between the shared code and a tier; each calls the module's
    function of the same name (``attention``, ``plan_options`` and ``make_runner``: the ``core`` module's, with
    ``kernel="core"``). The inputs were validated before a method is called (see :mod:`bsrattn.api`).

    Parameters
    ----------
    name : str
        The tier's name, as :data:`REGISTRY` lists it.
    module : module
        The tier's module, providing each of :data:`TIER_FUNCTIONS`, declaring :data:`TIER_FLAGS` or not.
    kernel : {"shipped", "core"}
        Which of the tier's kernels runs (:data:`KERNELS`); the tier must declare it.

    Raises
    ------
    TypeError
        ``module`` lacks one of :data:`TIER_FUNCTIONS` or declares a flag of the wrong type, or its ``core``
        lacks one of :data:`KERNEL_FUNCTIONS` (the message names the tier and what is missing).
    ValueError
        A ``kernel`` that is not one of the tier's.

    Examples
    --------
    >>> import bsrattn as ba
    >>> be = ba.get_backend("reference")
    >>> be.name, be.kernel, callable(be.merge_state)
    ('reference', 'shipped', True)
    """

    def __init__(self, name: str, module: ModuleType, kernel: str = "shipped") -> None:
        missing = [f for f in TIER_FUNCTIONS if not callable(getattr(module, f, None))]
        if missing:
            raise TypeError(f"backend {name!r} ({getattr(module, '__name__', module)!r}) does not provide "
                            f"{missing}; a tier provides each of {list(TIER_FUNCTIONS)}")
        flags = {flag: getattr(module, flag, default) for flag, default in TIER_FLAGS.items()}
        for flag, value in flags.items():
            if type(value) is not type(TIER_FLAGS[flag]):
                raise TypeError(f"backend {name!r}: {flag} is {value!r}; a tier declares it as a "
                                f"{type(TIER_FLAGS[flag]).__name__}")
        if not set(flags["KERNELS"]) <= set(KERNELS) or "shipped" not in flags["KERNELS"]:
            raise TypeError(f"backend {name!r}: KERNELS is {flags['KERNELS']!r}; a tier runs 'shipped' and may run "
                            f"others of {list(KERNELS)}")
        if not isinstance(kernel, str) or kernel not in KERNELS:
            raise ValueError(f"unknown kernel={kernel!r}; choose from {list(KERNELS)}")
        if kernel not in flags["KERNELS"]:
            raise ValueError(f"kernel={kernel!r}: the {name!r} tier runs only {list(flags['KERNELS'])}")
        self.name = name
        self.module = module
        self.kernel = kernel
        self._runs = module
        if kernel == "core":  # the teaching kernel: it folds no prior state and binds no runs
            self._runs = importlib.import_module(f"{module.__name__}.core")
            missing = [f for f in KERNEL_FUNCTIONS if not callable(getattr(self._runs, f, None))]
            if missing:
                raise TypeError(f"backend {name!r}: its core ({self._runs.__name__!r}) does not provide {missing}")
            flags.update(FOLDS_PRIOR=False, BINDS_RUNS=False, HEAD_DIM_VO=getattr(self._runs, "HEAD_DIM_VO", False))
        self._folds_prior = flags["FOLDS_PRIOR"]
        self._head_dim_vo = flags["HEAD_DIM_VO"]
        self._binds_runs = flags["BINDS_RUNS"]

    def attention(self, spec: AttentionSpec, q: Array, k: Array, v: Array, *, out: Array | None = None,
                  lse: Array | None = None, return_lse: bool = False, k_scale: float | None = None,
                  v_scale: float | None = None, prior: tuple | None = None) -> tuple[Array, Array | None]:
        """Attention over ``spec.layout`` (one BSRLayout): ``(out, lse)``, ``lse`` None unless ``return_lse``.

        ``q [nnz_qo, num_qo_heads, head_dim]``, ``k``/``v`` as ``spec.kv_view`` says; ``out``/``lse`` are
        buffers to write into, ``k_scale``/``v_scale`` the scales of the stored K and V (any KV dtype).

        Parameters
        ----------
        spec : AttentionSpec
            The validated layout, heads, variant, dtypes and KV view.
        q : array, ``[nnz_qo, num_qo_heads, head_dim]``
            The queries.
        k, v : arrays
            The KV pool, in the form ``spec.kv_view`` names.
        out, lse : arrays, optional
            Buffers to write into (``[nnz_qo, num_qo_heads, head_dim]``, ``[nnz_qo, num_qo_heads]``).
        return_lse : bool
            Whether to compute ``lse``.
        k_scale, v_scale : float, optional
            Scales of the stored K and V, of any KV dtype (fp8's dequantisation scales): scores are
            taken with ``k * k_scale`` and outputs made of ``v * v_scale``. None: 1.
        prior : (o, lse), optional
            A state of the same query rows that the kernel folds in first (``prior ⊕`` this one's); only on a
            tier that :attr:`folds_prior`.

        Returns
        -------
        (out, lse)
            ``lse`` is None unless ``return_lse``.
        """
        if prior is not None and not self.folds_prior:
            raise ValueError(f"prior: the {self.name!r} tier's {self.kernel} kernel folds no prior state; run "
                             f"without it and fold the states with merge_state")
        folded = {} if prior is None else {"prior": prior}  # a kernel that folds none takes no such argument
        self._check_widths(spec)
        return self._runs.attention(spec, q, k, v, out=out, lse=lse, return_lse=return_lse, k_scale=k_scale,
                                    v_scale=v_scale, **folded)

    @property
    def folds_prior(self) -> bool:
        """Whether the kernel's ``attention`` and runners' ``run`` take ``prior=(o, lse)``, a state of the same
        query rows that it folds in before writing (``FOLDS_PRIOR``, :data:`TIER_FLAGS`): a Cascade's levels are
        then merged without a launch of their own (:mod:`bsrattn.api`)."""
        return self._folds_prior

    @property
    def head_dim_vo(self) -> bool:
        """Whether the kernel takes ``v`` and ``out`` of another head dimension than ``q`` and ``k``
        (``HEAD_DIM_VO``, :data:`TIER_FLAGS`): ``head_dim_vo`` on :meth:`bsrattn.BatchAttention.plan`, and
        :mod:`bsrattn.mla`."""
        return self._head_dim_vo

    def _check_widths(self, spec: AttentionSpec) -> None:
        if spec.head_dim_vo is not None and not self.head_dim_vo:
            raise ValueError(f"head_dim_vo={spec.head_dim_vo} (v and out of another head dimension than q and k, "
                             f"head_dim={spec.head_dim}): the {self.name!r} tier's {self.kernel} kernel takes v "
                             f"as wide as k; run it on a tier whose kernel takes it (Backend.head_dim_vo)")

    @property
    def binds_runs(self) -> bool:
        """Whether the kernel's runners have ``bind`` (``BINDS_RUNS``, :data:`TIER_FLAGS`):
        :meth:`bsrattn.BatchAttention.run` then does the work that follows from its arguments' kinds once."""
        return self._binds_runs

    def merge_state(self, o_a: Array, lse_a: Array, o_b: Array, lse_b: Array) -> tuple[Array, Array]:
        """The ⊕ of two states ``o [..., H, D]``, ``lse [..., H]``: ``(o, lse)``.

        Parameters
        ----------
        o_a, o_b : arrays, ``[..., H, D]``
            The states' outputs.
        lse_a, lse_b : arrays, ``[..., H]``
            Their log-sum-exps, natural log.

        Returns
        -------
        (o, lse)
            The merged state, ``[..., H, D]`` and ``[..., H]``.
        """
        return self.module.merge_state(o_a, lse_a, o_b, lse_b)

    def merge_states(self, o: Array, lse: Array) -> tuple[Array, Array]:
        """Fold ``o [n, S, H, D]``, ``lse [n, S, H]`` over ``S`` in index order: ``(o [n, H, D], lse [n, H])``.

        Parameters
        ----------
        o : array, ``[n, S, H, D]``
            The states' outputs.
        lse : array, ``[n, S, H]``
            Their log-sum-exps, natural log.

        Returns
        -------
        (o, lse)
            The folded state, ``[n, H, D]`` and ``[n, H]``.
        """
        return self.module.merge_states(o, lse)

    def add_states(self, o_a: Array, o_b: Array) -> Array:
        """FlashSigmoid's merge, ``o_a + o_b`` (``[..., H, D]``): its weights are not normalised.

        Parameters
        ----------
        o_a, o_b : arrays, ``[..., H, D]``
            The two states' outputs.

        Returns
        -------
        array
            Their sum, ``[..., H, D]``.
        """
        return self.module.add_states(o_a, o_b)

    def plan_options(self, spec: AttentionSpec) -> dict[str, int]:
        """The tier's keyword arguments to :func:`bsrattn.scheduler.plan` for ``spec``: ``num_ctas``, ``tile_q``,
        ``min_split_size``, ``kv_align``.

        Parameters
        ----------
        spec : AttentionSpec
            The validated layout, heads, variant, dtypes and KV view the plan is for.

        Returns
        -------
        dict
            The keyword arguments, by name.
        """
        return self._runs.plan_options(spec)

    def make_runner(self, spec: AttentionSpec, work_plan: WorkPlan, previous: Any = None) -> Any:
        """An object with ``work_plan`` and ``run(q, k, v, *, out, lse, return_lse, k_scale, v_scale) -> (out,
        lse)`` that executes ``work_plan``; ``previous`` (the runner of the last plan) lets a tier refill its
        buffers in place.

        Parameters
        ----------
        spec : AttentionSpec
            The validated layout, heads, variant, dtypes and KV view.
        work_plan : WorkPlan
            The plan to execute.
        previous : runner, optional
            The runner of the previous plan, whose buffers the tier may reuse.

        Returns
        -------
        runner
            The tier's runner object.
        """
        self._check_widths(spec)
        return self._runs.make_runner(spec, work_plan, previous=previous)

    def __repr__(self):
        return f"Backend({self.name!r})" if self.kernel == "shipped" else f"Backend({self.name!r}, {self.kernel!r})"


def _cuda_torch_available() -> bool:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
        return False
    import torch

    return torch.cuda.is_available()


def _resolve_name(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"backend must be a name or a Backend, got {type(name).__name__}")
    if name == "auto":
        return "torch" if _cuda_torch_available() else "reference"
    if name not in REGISTRY:
        raise ValueError(f"unknown backend {name!r}; choose from {sorted(REGISTRY) + ['auto']}")
    return name


def current_backend_name() -> str:
    """The name the flag resolves to now (before ``auto`` is resolved).

    Returns
    -------
    str
        The innermost :func:`use_backend` name, else :func:`set_backend`'s, else ``BSRATTN_BACKEND``, else
        ``"reference"``.

    Examples
    --------
    >>> import bsrattn as ba
    >>> with ba.use_backend("numba"):       # naming a tier does not import it
    ...     ba.backends.current_backend_name()
    'numba'
    """
    return _scoped.get() or _global or os.environ.get("BSRATTN_BACKEND") or "reference"


def get_backend(name: str | Backend | None = None, kernel: str | None = None) -> Backend:
    """The :class:`Backend` for ``name`` (a name, a Backend, or None for the flag's current choice) running
    ``kernel``.

    Parameters
    ----------
    name : str or Backend, optional
        ``"reference"``, ``"numba"``, ``"torch"`` or ``"auto"``; a Backend is returned as it is; None: the
        flag's current choice.
    kernel : {"shipped", "core"}, optional
        The tier's kernel (:data:`KERNELS`); None: a Backend's own, else ``"shipped"``.

    Returns
    -------
    Backend
        The tier, its module imported on first use and kept.

    Raises
    ------
    TypeError
        ``name`` neither a str, a Backend nor None.
    ValueError
        An unknown name, or a ``kernel`` the tier does not run (``"core"`` on the reference tier).
    BackendError
        A tier whose dependency is not installed (the message names the install command).

    Examples
    --------
    >>> import bsrattn as ba
    >>> ba.get_backend("reference")
    Backend('reference')
    """
    if isinstance(name, Backend):
        if kernel is None or kernel == name.kernel:
            return name
        return Backend(name.name, name.module, kernel)
    resolved = _resolve_name(current_backend_name() if name is None else name)
    if kernel is not None and kernel != "shipped":
        key = (resolved, kernel)
        if key not in _loaded:
            _loaded[key] = Backend(resolved, get_backend(resolved).module, kernel)
        return _loaded[key]
    if resolved not in _loaded:
        for dep in _REQUIREMENTS.get(resolved, ((), ""))[0]:
            if importlib.util.find_spec(dep.split(".")[0]) is None:
                raise BackendError(f"backend {resolved!r} needs the package {dep!r}, which is not installed; "
                                   f"install it with: {_REQUIREMENTS[resolved][1]}")
        _loaded[resolved] = Backend(resolved, importlib.import_module(REGISTRY[resolved]))
    return _loaded[resolved]


def set_backend(name: str | None) -> None:
    """Make ``name`` the default backend of this program (``None`` restores the environment's choice).

    Parameters
    ----------
    name : str or None
        ``"reference"``, ``"numba"``, ``"torch"`` or ``"auto"`` (not imported until a call uses it), or None.

    Returns
    -------
    None

    Raises
    ------
    TypeError
        ``name`` not a str (or None).
    ValueError
        An unknown name.

    Examples
    --------
    >>> import bsrattn as ba
    >>> ba.set_backend("reference")
    >>> ba.get_backend().name
    'reference'
    >>> ba.set_backend(None)
    """
    global _global
    if name is not None:
        _resolve_name(name)
    _global = name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Use ``name`` for the calls inside the ``with`` block (nestable, thread- and task-local).

    Parameters
    ----------
    name : str
        ``"reference"``, ``"numba"``, ``"torch"`` or ``"auto"`` (not imported until a call uses it).

    Yields
    ------
    None
        The block runs with ``name`` as the flag's choice; the previous choice returns when it ends.

    Raises
    ------
    TypeError
        ``name`` not a str.
    ValueError
        An unknown name.

    Examples
    --------
    >>> import bsrattn as ba
    >>> with ba.use_backend("reference"):
    ...     ba.get_backend().name
    'reference'
    """
    _resolve_name(name)
    token = _scoped.set(name)
    try:
        yield
    finally:
        _scoped.reset(token)
