"""The backend registry and the flag that picks a tier.

A backend is a module implementing execution (see :class:`Backend` for the functions it provides). The
registry is an explicit dict of name -> module path, imported lazily: importing :mod:`bsrattn` imports
neither numba, torch nor triton. Which backend a call uses, first match wins:

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


class Backend:
    """A named tier: a thin handle on its module, which provides

    - ``attention(spec, q, k, v, *, out, lse, return_lse, k_scale, v_scale) -> (out, lse)``
    - ``merge_state(o_a, lse_a, o_b, lse_b) -> (o, lse)``, ``merge_states(o, lse) -> (o, lse)``,
      ``add_states(o_a, o_b) -> o`` (FlashSigmoid's merge)
    - ``plan_options(spec) -> dict`` (``num_ctas``, ``tile_q``, ``min_split_size``, ``kv_align``)
    - ``make_runner(spec, work_plan, previous=None)`` -> an object with ``run(q, k, v, *, out, lse,
      return_lse, k_scale, v_scale) -> (out, lse)``; ``previous`` lets a tier refill its buffers in place.

    Examples
    --------
    >>> import bsrattn as ba
    >>> be = ba.get_backend("reference")
    >>> be.name, callable(be.merge_state)
    ('reference', True)
    """

    def __init__(self, name: str, module):
        self.name = name
        self.module = module

    def __getattr__(self, attr):
        return getattr(self.module, attr)

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

    Examples
    --------
    >>> import bsrattn as ba
    >>> with ba.use_backend("numba"):       # naming a tier does not import it
    ...     ba.backends.current_backend_name()
    'numba'
    """
    return _scoped.get() or _global or os.environ.get("BSRATTN_BACKEND") or "reference"


def get_backend(name=None) -> Backend:
    """The :class:`Backend` for ``name`` (a name, a Backend, or None for the flag's current choice).

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


def set_backend(name: str) -> None:
    """Make ``name`` the default backend of this program (``None`` restores the environment's choice).

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
def use_backend(name: str):
    """Use ``name`` for the calls inside the ``with`` block (nestable, thread- and task-local).

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
