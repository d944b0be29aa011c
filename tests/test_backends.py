"""The backend flag: lazy imports, precedence, "auto", and errors that name the fix.

A probe module registered under a spare name records which entry point reached it and delegates to the
reference tier, so routing is observed without loading the numba or torch tiers.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import threading
import types

import numpy as np
import pytest

import bsrattn as ba
from bsrattn import backends, reference
from conftest import HAS_GPU


@pytest.fixture
def probe(monkeypatch):
    """A backend named "probe" that records its calls; the flag's state is restored after the test."""
    calls = []
    module = types.ModuleType("bsrattn_probe_backend")
    for name in ("attention", "merge_state", "merge_states", "add_states", "plan_options", "make_runner"):
        def record(*args, _name=name, **kwargs):
            calls.append(_name)
            return getattr(reference, _name)(*args, **kwargs)
        setattr(module, name, record)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(backends.REGISTRY, "probe", module.__name__)
    monkeypatch.setattr(backends, "_loaded", {})
    monkeypatch.setattr(backends, "_global", None)
    monkeypatch.delenv("BSRATTN_BACKEND", raising=False)
    return calls


def _inputs():
    rng = np.random.default_rng(0)
    layout = ba.layouts.ragged([1, 2], [5, 3])
    return (rng.standard_normal((3, 2, 4)), rng.standard_normal((8, 1, 4)), rng.standard_normal((8, 1, 4))), layout


def test_importing_bsrattn_imports_no_gpu_package():
    code = ("import sys, numpy as np, bsrattn as ba\n"
            "ba.attention(np.ones((1, 1, 4)), np.ones((2, 1, 4)), np.ones((2, 1, 4)), ba.layouts.dense(1, 2))\n"
            "print(sorted(m for m in ('numba', 'torch', 'triton') if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if k != "BSRATTN_BACKEND"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_default_is_reference(probe):
    assert backends.current_backend_name() == "reference"
    assert ba.get_backend().name == "reference"


def test_precedence_argument_scope_global_environment(probe, monkeypatch):
    monkeypatch.setenv("BSRATTN_BACKEND", "probe")
    assert ba.get_backend().name == "probe"
    ba.set_backend("reference")
    assert ba.get_backend().name == "reference"
    ba.set_backend("probe")
    with ba.use_backend("reference"):
        assert ba.get_backend().name == "reference"
        assert ba.get_backend("probe").name == "probe"
        with ba.use_backend("probe"):
            assert ba.get_backend().name == "probe"
        assert ba.get_backend().name == "reference"
    assert ba.get_backend().name == "probe"
    ba.set_backend(None)
    monkeypatch.setenv("BSRATTN_BACKEND", "reference")
    assert ba.get_backend().name == "reference"


def test_every_entry_point_follows_the_flag(probe):
    (q, k, v), layout = _inputs()
    with ba.use_backend("probe"):
        ba.attention(q, k, v, layout)
        attn = ba.BatchAttention()
        attn.plan(layout, 2, 1, 4, num_ctas=2)
        attn.run(q, k, v)
        ba.merge_state(q, q[..., 0], q, q[..., 0])
        ba.merge_states(q[:, None], q[:, None, :, 0])
    assert probe == ["attention", "plan_options", "make_runner", "merge_state", "merge_states"]
    probe.clear()
    ba.attention(q, k, v, layout)  # outside the block: the reference again
    assert probe == []


def test_backend_instances_pass_through(probe):
    be = ba.get_backend("probe")
    assert ba.get_backend(be) is be
    (q, k, v), layout = _inputs()
    ba.attention(q, k, v, layout, backend=be)
    assert probe == ["attention"]


def test_scoped_choice_is_local_to_its_thread(probe):
    seen = []
    with ba.use_backend("probe"):
        thread = threading.Thread(target=lambda: seen.append(backends.current_backend_name()))
        thread.start()
        thread.join()
        assert backends.current_backend_name() == "probe"
    assert seen == ["reference"]


def test_auto_is_reference_without_a_gpu(probe, monkeypatch):
    assert ba.get_backend("auto").name == ("torch" if HAS_GPU else "reference")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find_spec(name, *a))
    assert ba.get_backend("auto").name == "reference"


def test_auto_is_torch_with_a_gpu_and_triton(probe, monkeypatch):
    monkeypatch.setattr(backends, "_cuda_torch_available", lambda: True)
    monkeypatch.setitem(backends.REGISTRY, "torch", "bsrattn_probe_backend")
    monkeypatch.setitem(backends._REQUIREMENTS, "torch", ((), ""))
    assert ba.get_backend("auto").name == "torch"


@pytest.mark.parametrize("use", [
    lambda: ba.get_backend("cuda"),
    lambda: ba.set_backend("cuda"),
    lambda: ba.use_backend("cuda").__enter__(),
    lambda: ba.attention(*_inputs()[0], _inputs()[1], backend="cuda"),
    lambda: ba.BatchAttention(backend="cuda"),
], ids=["get_backend", "set_backend", "use_backend", "attention", "BatchAttention"])
def test_unknown_name_is_an_error_listing_the_choices(probe, use):
    with pytest.raises(ValueError, match=r"unknown backend 'cuda'; choose from \['numba', 'probe', 'reference', "):
        use()


def test_unknown_name_in_the_environment(probe, monkeypatch):
    monkeypatch.setenv("BSRATTN_BACKEND", "gpu")
    with pytest.raises(ValueError, match="unknown backend 'gpu'"):
        ba.get_backend()


@pytest.mark.parametrize("tier, package, fix", [("numba", "numba", "bsrattn[numba]"),
                                                ("torch", "torch", "bsrattn[torch]")])
def test_missing_dependency_names_the_fix(probe, monkeypatch, tier, package, fix):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else find_spec(name, *a))
    message = re.escape(f"backend '{tier}' needs the package '{package}'") + ".*" + re.escape(f"pip install '{fix}'")
    with pytest.raises(ba.BackendError, match=message):
        ba.get_backend(tier)


def test_backend_exposes_exactly_the_tier_functions():
    public = {name: x for name, x in vars(backends.Backend).items() if not name.startswith("_")}
    assert {name for name, x in public.items() if not isinstance(x, property)} == set(backends.TIER_FUNCTIONS)
    # Beyond them, what a tier declares of itself (TIER_FLAGS): whether its kernels fold a prior state (a Cascade's
    # levels), whether its runners bind a serving loop's calls, and whether they take values narrower than keys.
    assert {name for name, x in public.items() if isinstance(x, property)} == {"folds_prior", "binds_runs",
                                                                              "head_dim_vo"}
    assert not ba.get_backend("reference").folds_prior and not ba.get_backend("reference").binds_runs


def test_a_tier_that_takes_no_value_narrower_than_its_key_refuses_head_dim_vo(probe):
    (q, k, v), layout = _inputs()
    with pytest.raises(ValueError, match=r"head_dim_vo=2 .*the 'probe' tier's shipped kernel takes v as wide as k"):
        ba.attention(q, k, v[..., :2], layout, backend="probe")
    attn = ba.BatchAttention(backend="probe")
    with pytest.raises(ValueError, match=r"head_dim_vo=2 .*the 'probe' tier's shipped kernel"):
        attn.plan(layout, 2, 1, 4, head_dim_vo=2)
    assert "attention" not in probe and "make_runner" not in probe, "refused before the tier runs"
    assert ba.attention(q, k, v[..., :2], layout, backend="reference").shape == (3, 2, 2)


@pytest.mark.parametrize("flag, value, message", [("FOLDS_PRIOR", 1, "FOLDS_PRIOR is 1; a tier declares it as a bool"),
                                                  ("KERNELS", ("core",), "KERNELS is ('core',); a tier runs 'shipped'"),
                                                  ("KERNELS", ("shipped", "fast"), "KERNELS is ('shipped', 'fast')")])
def test_a_tier_declaring_a_flag_wrongly_is_refused_at_load(probe, monkeypatch, flag, value, message):
    monkeypatch.setattr(sys.modules["bsrattn_probe_backend"], flag, value, raising=False)
    with pytest.raises(TypeError, match=re.escape(f"backend 'probe': {message}")):
        ba.get_backend("probe")


@pytest.mark.parametrize("kernel, message", [("core", "kernel='core': the 'reference' tier runs only ['shipped']"),
                                             ("fast", "unknown kernel='fast'; choose from ['shipped', 'core']"),
                                             (1, "unknown kernel=1")])
def test_a_kernel_the_tier_does_not_run_is_refused_by_name(kernel, message):
    q, kv = np.zeros((1, 2, 8)), np.zeros((4, 2, 8))
    layout = ba.layouts.ragged([1], [4])
    for call in (lambda: ba.attention(q, kv, kv, layout, backend="reference", kernel=kernel),
                 lambda: ba.BatchAttention("reference", kernel=kernel),
                 lambda: ba.get_backend("reference", kernel)):
        with pytest.raises(ValueError, match=re.escape(message)):
            call()


def test_the_shipped_kernel_is_the_default_and_named_alike():
    be = ba.get_backend("reference")
    assert be.kernel == "shipped" and ba.get_backend("reference", "shipped") is be
    assert ba.get_backend(be, None) is be and ba.BatchAttention("reference", kernel="shipped").backend is be


def test_a_prior_state_on_a_tier_that_folds_none_is_refused_by_name():
    be = ba.get_backend("reference")
    q, kv = np.zeros((1, 2, 8), np.float32), np.zeros((4, 2, 8), np.float32)
    spec = ba.validation.spec_from_inputs(q, kv, kv, ba.layouts.ragged([1], [4]), ba.Variant(), "NHD")
    assert np.array_equal(be.attention(spec, q, kv, kv)[0], q)  # the call itself is fine without it
    with pytest.raises(ValueError, match="prior: the 'reference' tier's shipped kernel folds no prior state"):
        be.attention(spec, q, kv, kv, prior=(q, np.zeros((1, 2), np.float32)))


@pytest.mark.parametrize("tier", sorted(backends.REGISTRY))
def test_each_tier_that_loads_provides_every_tier_function(tier):
    try:
        be = ba.get_backend(tier)
    except ba.BackendError as err:
        pytest.skip(f"{tier} tier unavailable: {err}")
    assert all(callable(getattr(be.module, name, None)) for name in backends.TIER_FUNCTIONS)


def test_a_tier_missing_a_function_is_refused_at_load(probe, monkeypatch):
    module = sys.modules["bsrattn_probe_backend"]
    monkeypatch.delattr(module, "add_states")
    monkeypatch.setattr(module, "plan_options", None)
    with pytest.raises(TypeError, match=re.escape("backend 'probe' ('bsrattn_probe_backend') does not provide "
                                                  "['add_states', 'plan_options']")):
        ba.get_backend("probe")
    assert "probe" not in backends._loaded
