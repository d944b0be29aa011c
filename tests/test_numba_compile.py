"""Every numba-tier kernel compiles for sm_90 (H100/H200) with the argument types real calls give it.

The simulator runs kernels as Python and accepts code that Numba's CUDA compiler rejects, so the tier's
kernels are also compiled for real, without a GPU: ``tests/numba_sm90_compile.py`` runs in a subprocess with
the simulator off (it needs ``numba-cuda[cu13]``'s NVVM, not a device).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba.cuda", reason="the numba tier needs numba-cuda")

SCRIPT = Path(__file__).with_name("numba_sm90_compile.py")
NO_COMPILER = 77
PARTS = 2


def test_every_kernel_compiles_for_sm90():
    """The kernels in two shares, one process each, compiled at once (NVVM runs on one core)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPT.parent.parent), os.environ.get("PYTHONPATH")]))
    parts = [subprocess.Popen([sys.executable, str(SCRIPT), "--part", f"{i}/{PARTS}"], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=SCRIPT.parent.parent)
             for i in range(PARTS)]
    try:
        outputs = [part.communicate(timeout=900) for part in parts]
    finally:
        for part in parts:
            part.kill()  # any still running after a timeout
    counts = []
    for part, (stdout, stderr) in zip(parts, outputs):
        if part.returncode == NO_COMPILER:
            pytest.skip(f"no CUDA compiler here (install numba-cuda[cu13]): {stdout.strip()[-300:]}")
        assert part.returncode == 0, stdout[-4000:] + stderr[-4000:]
        found = re.search(r"(\d+) of (\d+) kernels compiled for sm_90, 0 failed", stdout)
        assert found, stdout[-4000:]
        counts.append(found.groups())
    assert sum(int(done) for done, _ in counts) == int(counts[0][1]), f"the shares miss kernels: {counts}"
