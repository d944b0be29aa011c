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


class Backend:
    """A named tier: a handle on its module, which must provide each of :data:`TIER_FUNCTIONS`.

    The methods below are the whole interface between the shared code and a tier; each calls the module's
    function of the same name. The inputs were validated before a method is called (see :mod:`bsrattn.api`).

    Parameters
    ----------
    name : str
        The tier's name, as :data:`REGISTRY` lists it.
    module : module
        The tier's module, providing each of :data:`TIER_FUNCTIONS`.

    Raises
    ------
    TypeError
        ``module`` lacks one of :data:`TIER_FUNCTIONS` (the message names the tier and what is missing).

    Examples
    --------
    >>> import bsrattn as ba
    >>> be = ba.get_backend("reference")
    >>> be.name, callable(be.merge_state)
    ('reference', True)
    """

    def __init__(self, name: str, module: ModuleType) -> None:
        missing = [f for f in TIER_FUNCTIONS if not callable(getattr(module, f, None))]
        if missing:
            raise TypeError(f"backend {name!r} ({getattr(module, '__name__', module)!r}) does not provide "
                            f"{missing}; a tier provides each of {list(TIER_FUNCTIONS)}")
        self.name = name
        self.module = module

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
            raise ValueError(f"prior: the {self.name!r} tier's kernel folds no prior state; run without it and fold "
                             f"the states with merge_state")
        folded = {} if prior is None else {"prior": prior}  # a tier that folds none takes no such argument
        return self.module.attention(spec, q, k, v, out=out, lse=lse, return_lse=return_lse, k_scale=k_scale,
                                     v_scale=v_scale, **folded)

    @property
    def folds_prior(self) -> bool:
        """Whether the tier's ``attention`` and runners' ``run`` take ``prior=(o, lse)``, a state of the same query
        rows that the kernel folds in before writing (the module sets ``FOLDS_PRIOR``): a Cascade's levels are
        then merged without a launch of their own (:mod:`bsrattn.api`)."""
        return bool(getattr(self.module, "FOLDS_PRIOR", False))

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
        return self.module.plan_options(spec)

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
        return self.module.make_runner(spec, work_plan, previous=previous)

    def __repr__(self):
        return f"Backend({self.name!r})"


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


def get_backend(name: str | Backend | None = None) -> Backend:
    """The :class:`Backend` for ``name`` (a name, a Backend, or None for the flag's current choice).

    Parameters
    ----------
    name : str or Backend, optional
        ``"reference"``, ``"numba"``, ``"torch"`` or ``"auto"``; a Backend is returned as it is; None: the
        flag's current choice.

    Returns
    -------
    Backend
        The tier, its module imported on first use and kept.

    Raises
    ------
    TypeError
        ``name`` neither a str, a Backend nor None.
    ValueError
        An unknown name.
    BackendError
        A tier whose dependency is not installed (the message names the install command).

    Examples
    --------
    >>> import bsrattn as ba
    >>> ba.get_backend("reference")
    Backend('reference')
    """
    if isinstance(name, Backend):
        return name
    resolved = _resolve_name(current_backend_name() if name is None else name)
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
