"""The tiers a notebook can run here, and the one-line comparison its "tiers agree" cells print."""

from __future__ import annotations

import importlib.util

import bsrattn as ba
import bsrattn.testing

TIERS = ("reference", "numba", "torch")


def available():
    """Names of the tiers whose packages are installed here; says why any other one is left out."""
    names = []
    for name in TIERS:
        try:
            ba.get_backend(name)
        except ba.BackendError as err:
            print(f"{name}: left out ({err})")
        else:
            names.append(name)
    return names


def torch_extra_installed() -> bool:
    """Whether torch and Triton, what the torch tier imports (the torch extra), are installed here, GPU or not."""
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "triton"))


def check(name, actual, expected, op="attention", dtype="float32"):
    """Assert that ``actual`` matches ``expected`` within the tolerance table; print by how much."""
    atol, rtol = bsrattn.testing.tolerance(op, dtype)
    result = bsrattn.testing.assert_close(actual, expected, op=op, dtype=dtype, name=name)
    print(f"{name:>9}: max |err| {result.max_abs:.1e}   (allowed for {op} in {dtype}: atol {atol:g} + rtol {rtol:g})")
    return result
