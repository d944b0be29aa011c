"""Aliases of the public signatures. Annotations only: bsrattn checks its inputs itself, at run time."""

from __future__ import annotations

from typing import Any

Array = Any
"""An array of any kind a tier accepts: a NumPy array, a torch tensor or a Numba device array (anything with
``__cuda_array_interface__``). A tier returns the kind it was given."""

DType = Any
"""A dtype: its name (``"float16"``), a NumPy dtype or a torch dtype."""
