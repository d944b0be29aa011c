"""What a serving loop adds over checking every call: arguments like the last ones that passed skip the checks.

A model calls attention once a layer with the same layout, buffers and flags; the checks of
:mod:`bsrattn.validation` read only the layout (immutable), the variant, the storage order and the arguments'
kinds (:func:`run_key`), so a call whose key equals the last passing one's passes them too. Three places keep
such a key: a one-shot call over a BSRLayout (:data:`ONE_SHOT`), :meth:`bsrattn.BatchAttention.run`
(:class:`Passed`), and a re-plan with the very argument objects of the last plan (:func:`spec_like`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bsrattn.layout import BSRLayout
from bsrattn.validation import AttentionSpec
from bsrattn.variant import Variant

__all__ = ["run_key", "Passed", "ONE_SHOT", "spec_like"]


def run_key(q: Any, k: Any, v: Any, out: Any, lse: Any, return_lse: bool, k_scale: Any,
            v_scale: Any) -> tuple | None:
    """What :meth:`AttentionSpec.check_run` reads of ``run``'s arguments: each array's type, shape, dtype and
    device (and a NumPy buffer's writability), the flag and the scales with their types (``True`` equals 1 but
    is refused as a scale); None when an argument is not an array.

    Parameters
    ----------
    q, k, v, out, lse : arrays (``out``, ``lse`` may be None)
        The call's arrays.
    return_lse : bool
        The call's flag.
    k_scale, v_scale : float or None
        The call's scales.

    Returns
    -------
    tuple or None
        The key; None when an argument is not an array (the checks then say what it is).

    Examples
    --------
    >>> import numpy as np
    >>> x = np.zeros((2, 1, 4))
    >>> run_key(x, x, x, None, None, False, None, None) == run_key(x + 1, x, x, None, None, False, None, None)
    True
    """
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


class Passed:
    """The key of the last call that passed the checks, and what was made for arguments of that key."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.value: Any = None

    def get(self, key: tuple | None, check: Callable[[], Any]) -> Any:
        """``value`` for a call of ``key``: the last one's when ``key`` is the last passing key, else ``check()``.

        Parameters
        ----------
        key : tuple or None
            The call's key (None: never equal to any, the checks always run).
        check : callable
            Runs the checks: raises for arguments that fail them, else returns what to keep for the key.

        Returns
        -------
        object
            What ``check`` returned for this key, now or for the last call that passed.
        """
        if key is None or key != self.key:
            self.key, self.value = None, check()
            self.key = key
        return self.value

    def forget(self) -> None:
        """Drop the key: the next call is checked (a re-plan changes what the checks compare with)."""
        self.key = self.value = None


ONE_SHOT = Passed()
"""A one-shot call's: keyed on ``(layout object, variant, kv_layout, run key)``, holding its checked spec."""


def spec_like(previous: AttentionSpec, level: BSRLayout, variant: Variant) -> AttentionSpec | None:
    """``previous`` (a spec checked on a plan with the very same argument objects) for ``level`` and ``variant``,
    or None when the variant differs: the checks of the plan arguments need not run again.

    Parameters
    ----------
    previous : AttentionSpec
        The last plan's spec of this level.
    level : BSRLayout
        This plan's level.
    variant : Variant
        This plan's variant of the level.

    Returns
    -------
    AttentionSpec or None
        ``previous``'s checked arguments over ``level``; None when ``variant`` is not ``previous``'s.
    """
    if previous.variant is not variant and previous.variant != variant:
        return None
    return AttentionSpec(level, previous.num_qo_heads, previous.num_kv_heads, previous.head_dim, previous.variant,
                         previous.q_dtype, previous.kv_dtype, previous.kv_view, head_dim_vo=previous.head_dim_vo)
