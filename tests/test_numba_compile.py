"""Every numba-tier kernel compiles for sm_90 (H100/H200) with the argument types real calls give it.

The simulator runs kernels as Python and accepts code that Numba's CUDA compiler rejects, so the tier's
kernels are also compiled for real, without a GPU: ``tests/numba_sm90_compile.py`` runs in a subprocess with
the simulator off (it needs ``numba-cuda[cu13]``'s NVVM, not a device).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba.cuda", reason="the numba tier needs numba-cuda")

SCRIPT = Path(__file__).with_name("numba_sm90_compile.py")
NO_COMPILER = 77


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    result = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900,
                            check=False, cwd=SCRIPT.parent.parent)
    if result.returncode == NO_COMPILER:
        pytest.skip(f"no CUDA compiler here (install numba-cuda[cu13]): {result.stdout.strip()[-300:]}")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert " 0 failed" in result.stdout
