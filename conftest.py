"""Test set-up for every test and doctest: simulators on machines without a GPU, Hypothesis profiles, gpu skips.

At the repository root so that `--doctest-modules` items under `bsrattn/` get the simulators too, whichever
paths pytest is given.
"""

import os
import shutil
import subprocess


def _has_cuda_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


HAS_GPU = _has_cuda_gpu()
# These must be set before numba or triton is first imported.
if not HAS_GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# The mutation check (tests/mutation_check.py): a fault needs one failing example, not the smallest one.
settings.register_profile("mutants", settings.get_profile("ci"), phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.register_profile("dev", deadline=None, max_examples=100)
settings.register_profile("gpu", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: none here (run on the H200 through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
