"""The machine a figure comes from: its environment, and the two ceilings every bound is measured against.

:func:`measure_ceilings` times a device-to-device copy and a bf16 GEMM in the same process as the workload;
:func:`bound` turns a configuration's needed bytes and FLOPs into the time those ceilings allow.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess

import numpy as np

from benchmarks.records import ROOT

PACKAGES = ("torch", "triton", "numba", "numba-cuda", "numpy", "flashinfer-python", "apache-tvm-ffi", "bsrattn")


def _version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args):
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def environment(gpu: bool = True) -> dict:
    """Where the figures come from: GPU, driver, package versions, git commit (``BENCH_GIT_COMMIT`` when set).

    The override wins because a copy of the tree on a GPU machine may carry a stale ``.git``.

    ``gpu=False`` (a CPU-only workload) leaves torch unimported.
    """
    env = {
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "packages": {name: _version(name) for name in PACKAGES},
        "git_commit": os.environ.get("BENCH_GIT_COMMIT") or _git("rev-parse", "HEAD"),
        "git_dirty": None,
        "env": {k: os.environ[k] for k in ("FLASHINFER_CUDA_ARCH_LIST", "BSRATTN_BACKEND", "MAX_JOBS")
                if k in os.environ},
    }
    status = None if os.environ.get("BENCH_GIT_COMMIT") else _git("status", "--porcelain", "--untracked-files=no")
    if status is not None:
        env["git_dirty"] = bool(status)
    if not gpu:
        return env
    import torch

    env["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = {"name": props.name, "sms": props.multi_processor_count,
                      "memory_gib": round(props.total_memory / 2**30, 1),
                      "compute_capability": f"{props.major}.{props.minor}",
                      "l2_mib": round(getattr(props, "L2_cache_size", 0) / 2**20, 1)}
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            env["gpu"]["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, IndexError):
            env["gpu"]["driver"] = None
    return env


def _event_times_us(run, n):
    import torch

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


def _copy_us(reps: int) -> float:
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    return float(np.median(_event_times_us(lambda: dst.copy_(src), reps)))


def _gemm_us(n: int, reps: int) -> float:
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    return float(np.median(_event_times_us(lambda: a @ b, reps)))


def measure_ceilings(reps: int = 20) -> dict:
    """The two ceilings, measured here: device-to-device copy (bytes read + written) and bf16 GEMM 8192^3."""
    import torch

    n = 8192
    copy_us, gemm_us = _copy_us(reps), _gemm_us(n, reps)
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * (1 << 30) / (copy_us * 1e-6), "copy_us": copy_us, "copy_bytes": 2 * (1 << 30),
            "gemm_flops_per_s": 2 * n**3 / (gemm_us * 1e-6), "gemm_us": gemm_us, "gemm_shape": [n, n, n],
            "reps": reps}


def bound(ceilings: dict | None, bytes_needed: int | None = None, flops: int | None = None) -> dict:
    """Physical bound in µs: needed bytes / copy bandwidth and FLOPs / matmul rate; the larger one binds.

    >>> bound({"copy_bytes_per_s": 4e12, "gemm_flops_per_s": 8e14}, bytes_needed=4_000_000, flops=8e8)
    {'bytes_us': 1.0, 'flops_us': 1.0, 'bound_us': 1.0, 'bound': 'bytes'}
    """
    out = {}
    if ceilings is None:
        return out
    if bytes_needed is not None:
        out["bytes_us"] = bytes_needed / ceilings["copy_bytes_per_s"] * 1e6
    if flops is not None:
        out["flops_us"] = flops / ceilings["gemm_flops_per_s"] * 1e6
    if out:
        kind = max(out, key=out.get)
        out["bound_us"] = out[kind]
        out["bound"] = kind.removesuffix("_us")
    return out
