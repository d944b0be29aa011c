"""Timing and validation shared by every workload script: the method of BENCHMARKS.md, written once.

Every GPU figure goes through :meth:`Suite.measure`, which does, in this order:

1. **build** the implementation; one that cannot be built here (a missing tier, FlashInfer not importable, an
   API that refuses the shape) is recorded as ``unavailable: <reason>`` and the suite goes on;
2. **correctness first**: poison the output (NaN in the ``out`` buffer, NaN in the caching allocator's free
   blocks), run once, and compare sampled query rows with the float64 reference tier on the same inputs
   (:func:`reference_rows`, :func:`bsrattn.testing.compare`, the tolerance table). A wrong answer is recorded
   as ``incorrect`` and never timed;
3. **eager**: flush L2 (zero a 256 MiB buffer), synchronize, then time one call from Python with CUDA events
   (the interval includes the host's launch cost, as a user sees it); median of ``samples`` (>= 100) after
   warm-up;
4. **graph**: capture the call in a ``torch.cuda.CUDAGraph``, check one replay the same way, then time
   replays, each after an L2 flush queued ahead of it (GPU time: the launch is hidden behind the flush);
5. **bound**: bytes the work needs over the copy bandwidth, or FLOPs over the bf16 matmul rate, both measured
   in the same process (:func:`measure_ceilings`); the fraction achieved is bound / measured time.

Host-side costs (``plan()``) go through :meth:`Suite.measure_host` (wall clock, including a device
synchronize so copies to the GPU are counted). Results are written after every configuration to
``benchmarks/results/<workload>.json`` with the environment and the ceilings, so a run cut short keeps what
it measured.

``--dry-run`` runs tiny shapes on the CPU, checks correctness only and times nothing: the plumbing of every
script can be exercised on a machine without a GPU (the tests do).
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import gc
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

import bsrattn as ba
from bsrattn.testing import compare, tolerance

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
FLUSH_BYTES = 256 << 20
# Host float64 copies of the checked KV rows are kept under this many elements (K and V each).
CHECK_ELEMENTS = 1 << 26
PACKAGES = ("torch", "triton", "numba", "numba-cuda", "numpy", "flashinfer-python", "apache-tvm-ffi", "bsrattn")

# FlashInfer reads this when it JIT-compiles; set before anything imports it.
os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")


class Unavailable(Exception):
    """An implementation that cannot run here; the reason is recorded and the suite goes on."""


# ---- progress ---------------------------------------------------------------------------------------------
class Progress:
    """tqdm when it is importable, else one counter line per step on stderr."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.done = total, desc, 0
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)

    def update(self, note: str = ""):
        self.done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(1)
        else:
            print(f"[{self.desc}] {self.done}/{self.total} {note}", file=sys.stderr, flush=True)

    def note(self, text: str):
        if self._bar is not None:
            self._bar.set_postfix_str(text)

    def close(self):
        if self._bar is not None:
            self._bar.close()


# ---- environment and ceilings -----------------------------------------------------------------------------
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


def stats(times_us) -> dict:
    """Median and spread of a list of samples in µs.

    >>> stats([3.0, 1.0, 2.0])["median_us"]
    2.0
    """
    t = np.asarray(times_us, dtype=np.float64)
    return {"median_us": float(np.median(t)), "p10_us": float(np.percentile(t, 10)),
            "p90_us": float(np.percentile(t, 90)), "min_us": float(t.min()), "samples": int(t.size)}


# ---- correctness ------------------------------------------------------------------------------------------
def _query_rows(layout):
    """``[nnz_qo]`` block row of each query row."""
    return np.repeat(np.arange(layout.num_rows), layout.qo_lens)


def visible_slots(layout, i: int, causal: bool) -> np.ndarray:
    """Pool slots query row ``i`` attends: its row's slots, cut at its logical position when causal."""
    r = int(_query_rows(layout)[i])
    slots = layout.kv_slots(r)
    if causal:
        pos = int(layout.kv_lens[r]) - int(layout.qo_lens[r]) + (i - int(layout.qo_indptr[r]))
        slots = slots[:max(pos + 1, 0)]
    return slots


def sample_rows(layout, num_kv_heads: int, head_dim: int, *, causal: bool = False, max_rows: int = 32,
                max_elements: int = CHECK_ELEMENTS) -> np.ndarray:
    """Query rows to check: spread over the batch (first, last, then evenly between), within a host budget.

    Rows are added while the distinct KV slots they see (``x num_kv_heads x head_dim`` elements; a slot two
    rows share, such as a shared prefix, counts once) fit in ``max_elements``; the first row is always kept.
    """
    n = layout.nnz_qo
    spread = np.unique(np.linspace(0, n - 1, min(max_rows, n)).round().astype(np.int64))
    order = [int(spread[0])] + ([int(spread[-1])] if spread.size > 1 else []) + [int(i) for i in spread[1:-1]]
    seen = np.zeros(layout.num_slots, dtype=bool)
    rows, used = [], 0
    for i in order:
        slots = visible_slots(layout, i, causal)
        cost = int(np.count_nonzero(~seen[slots])) * num_kv_heads * head_dim
        if rows and used + cost > max_elements:
            continue
        seen[slots] = True
        rows.append(i)
        used += cost
    return np.array(sorted(rows), dtype=np.int64)


def _index(x, idx: np.ndarray):
    """``idx`` as an index of ``x``: a torch tensor on ``x``'s device for torch, the array itself for NumPy."""
    if hasattr(x, "detach"):
        import torch

        return torch.as_tensor(idx, dtype=torch.int64, device=x.device)
    return idx


def _take_slots(x, kv_layout: str, block_size: int, slots: np.ndarray):
    """``[n, num_kv_heads, head_dim]``: the KV rows at pool ``slots`` of ``x`` in its storage layout."""
    if kv_layout == "HND":
        return x[_index(x, slots // block_size), :, _index(x, slots % block_size), :]
    return x.reshape(-1, x.shape[-2], x.shape[-1])[_index(x, slots)]


def _float64(x, scale=None) -> np.ndarray:
    if hasattr(x, "detach"):
        import torch

        x = x.detach().to(dtype=torch.float64).cpu().numpy()
    else:
        x = np.asarray(x, dtype=np.float64)
    return x * scale if scale is not None else x


def reference_rows(layout, q, k, v, rows, *, kv_layout: str = "NHD", causal: bool = False, k_scale=None,
                   v_scale=None) -> np.ndarray:
    """float64 reference output ``[len(rows), num_qo_heads, head_dim]`` of query rows ``rows``.

    Gathers only the KV slots those rows see (from torch tensors on any device, or NumPy arrays), dequantises
    fp8 with its scale exactly as the reference tier does (``x.astype(f64) * scale``), and runs the reference
    tier on a vector-sparse layout of one query per row. A causal row keeps the keys up to its logical
    position, so the result equals that row of the full attention (see the tests).

    Parameters
    ----------
    layout : BSRLayout
    q : ``[nnz_qo, num_qo_heads, head_dim]``
    k, v : the pool in ``kv_layout`` storage: NHD ``[num_blocks, block_size, Hkv, D]`` (or ``[N, Hkv, D]``), or
        HND ``[num_blocks, Hkv, block_size, D]``
    rows : ``[n]`` query row indices
    """
    lists = [visible_slots(layout, int(i), causal) for i in rows]
    # Each distinct slot is gathered once (rows of a shared prefix or of one causal request overlap).
    slots, position = np.unique(np.concatenate(lists) if lists else np.zeros(0, np.int64), return_inverse=True)
    k_rows = _float64(_take_slots(k, kv_layout, layout.block_size, slots), k_scale)
    v_rows = _float64(_take_slots(v, kv_layout, layout.block_size, slots), v_scale)
    offsets = np.concatenate([[0], np.cumsum([s.size for s in lists])])
    sub = ba.layouts.vector_sparse([position[offsets[j]:offsets[j + 1]] for j in range(len(lists))],
                                   np.ones(len(lists), dtype=np.int64), num_slots=int(slots.size))
    q_rows = _float64(q[_index(q, np.asarray(rows, dtype=np.int64))])
    return ba.attention(q_rows, k_rows, v_rows, sub, backend="reference")


def _as_tensor(y):
    """The output of a call as a torch tensor (tuples give their first element; Numba arrays are wrapped)."""
    import torch

    if isinstance(y, (tuple, list)):
        y = y[0]
    if isinstance(y, torch.Tensor):
        return y
    if hasattr(y, "__cuda_array_interface__"):
        return torch.as_tensor(y, device="cuda")
    return torch.as_tensor(np.asarray(y))


def check_output(y, *, shape, rows, expected, dtype: str, view=None) -> dict:
    """Compare rows ``rows`` of output ``y`` (after ``view``, reshaped to ``shape``) with ``expected``."""
    import torch

    t = _as_tensor(y)
    if view is not None:
        t = view(t)
    t = t.reshape(shape)[torch.as_tensor(rows, device=t.device)]
    atol, rtol = tolerance("attention", dtype)
    result = compare(t, expected, atol, rtol)
    return {"ok": bool(result.ok), "max_abs_err": result.max_abs, "rows_checked": int(len(rows)),
            "atol": atol, "rtol": rtol, "message": result.message}


def _fill_nan(y):
    _as_tensor(y).fill_(float("nan"))


def _poison_allocator(nbytes: int):
    """Fill the caching allocator's free memory with NaN, so an output it hands out holds no stale answer.

    After ``empty_cache`` the only free blocks are the ones made here: one large block for large outputs and
    a few 1 MiB blocks, which fill the small pool's 2 MiB segments.
    """
    import torch

    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    size = int(min(max(nbytes, 64 << 20), free // 4)) // 2 * 2
    blocks = [torch.empty(size // 2, dtype=torch.float16, device="cuda")]
    blocks += [torch.empty(1 << 19, dtype=torch.float16, device="cuda") for _ in range(8)]
    for b in blocks:
        b.fill_(float("nan"))
    torch.cuda.synchronize()
    del blocks


def _synchronize():
    import torch

    torch.cuda.synchronize()


def require_free(nbytes: int, what: str):
    """Raise :class:`Unavailable` unless the GPU has ``nbytes`` free (plus 2 GiB of headroom) for ``what``."""
    import torch

    if not torch.cuda.is_available():
        return
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if free < nbytes + (2 << 30):
        raise Unavailable(f"{what} needs {nbytes / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text[:600]


# ---- bsrattn through its public API ----------------------------------------------------------------------
NOT_CAPTURED = {"numba": "not captured: numba launches on the legacy default stream, outside torch's capture"}


def bsrattn_build(tier: str, layout, q, k, v, *, plan: dict, out=None, run: dict | None = None):
    """``build`` for :meth:`Suite.measure`: ``BatchAttention(tier).plan(layout, **plan)`` once, then
    ``run(q, k, v, out=out, **run)`` per call (the timed part).

    The reference tier (dry runs) is given NumPy copies and no ``out``: it runs on NumPy arrays.
    """
    run = run or {}

    def build():
        attn = ba.BatchAttention(backend=tier)
        attn.plan(layout, **plan)
        if tier == "reference":
            arrays = [x.detach().cpu().numpy() for x in (q, k, v)]
            return lambda: attn.run(*arrays, **run)
        return lambda: attn.run(q, k, v, out=out, **run)

    return build


def measure_bsrattn(suite, config: dict, name: str, tier: str, layout, q, k, v, *, plan: dict, out=None,
                    run: dict | None = None, **checking):
    """:meth:`Suite.measure` of one bsrattn tier through ``BatchAttention`` (see :func:`bsrattn_build`)."""
    return suite.measure(config, name, bsrattn_build(tier, layout, q, k, v, plan=plan, out=out, run=run),
                         out=out if tier != "reference" else None, graph=NOT_CAPTURED.get(tier, True), **checking)


# ---- the suite --------------------------------------------------------------------------------------------
def run_script(workload: str, title: str, run, doc: str, argv=None):
    """A workload script's ``main``: its suite from the command line, ``run(suite)``, then the JSON written."""
    suite = Suite.from_argv(workload, title, argv, doc=doc)
    run(suite)
    suite.finish()


def parser(description: str) -> argparse.ArgumentParser:
    """The options every workload script takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="few configurations (fits a short GPU lease)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes on the CPU, correctness only, no timing; writes JSON only with --results")
    p.add_argument("--samples", type=int, default=None, help="timed samples per mode (default 300, quick 100)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 20, quick 10)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds; configurations not started by then are recorded as skipped")
    p.add_argument("--results", type=Path, default=None, help=f"output folder (default {RESULTS_DIR})")
    p.add_argument("--impls", default=None, help="comma-separated glob patterns of implementations to run")
    p.add_argument("--seed", type=int, default=0)
    return p


class Suite:
    """One workload's run: its options, environment, ceilings, records and JSON file.

    Parameters
    ----------
    workload : str
        File stem, e.g. ``"w1_quest_decode"``; results go to ``<results>/<workload>.json``.
    title : str
    args : argparse.Namespace
        From :func:`parser`.
    gpu : bool
        Whether the workload needs a CUDA GPU (all but workload 7).
    """

    def __init__(self, workload: str, title: str, args, *, gpu: bool = True):
        self.workload, self.title, self.args = workload, title, args
        self.quick, self.dry_run = bool(args.quick), bool(args.dry_run)
        self.samples = args.samples or (100 if self.quick else 300)
        self.warmup = args.warmup if args.warmup is not None else (10 if self.quick else 20)
        self.rng = np.random.default_rng(args.seed)
        self.patterns = [p.strip() for p in args.impls.split(",")] if args.impls else None
        self.results_dir = args.results if args.results is not None else (None if self.dry_run else RESULTS_DIR)
        self.records: list = []
        self.started = time.time()
        self.deadline = self.started + args.time_budget if args.time_budget else None
        self.gpu = gpu and not self.dry_run
        self.device = "cuda" if self.gpu else "cpu"
        self.ceilings = None
        self._flush = None
        self.environment = environment(self.gpu)
        if self.gpu:
            import torch

            if not torch.cuda.is_available():
                raise SystemExit(f"{workload}: needs a CUDA GPU (none here); use --dry-run to check the plumbing")
            torch.manual_seed(args.seed)
            self.ceilings = measure_ceilings(reps=10 if self.quick else 20)
            self._flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    @classmethod
    def from_argv(cls, workload: str, title: str, argv=None, *, gpu: bool = True, doc: str | None = None):
        return cls(workload, title, parser(doc or title).parse_args(argv), gpu=gpu)

    # -- bookkeeping --
    @property
    def command(self) -> str:
        flags = " --quick" if self.quick else ""
        return f"python3 benchmarks/{self.workload}.py{flags}"

    def selected(self, impl: str) -> bool:
        return self.patterns is None or any(fnmatch.fnmatch(impl, p) for p in self.patterns)

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.time() > self.deadline

    def configs(self, items, config_of):
        """Yield ``(item, config)`` per item, ``config = config_of(item)`` being its record's configuration, with a
        progress bar; write the JSON after each; past the time budget, record the rest as skipped (the first one
        always runs, so every workload reports something)."""
        items = list(items)
        bar = Progress(len(items), self.workload)
        try:
            for i, item in enumerate(items):
                config = config_of(item)
                if i and self.out_of_time():
                    self.records.append({"config": config, "impl": "*", "status": "skipped",
                                         "reason": "time budget spent before this configuration started"})
                    bar.update(f"{config_label(config)}: skipped (time budget)")
                    continue
                self._bar = bar
                yield item, config
                self.release(collect=True)
                self.write()
                bar.update(config_label(config))
        finally:
            bar.close()

    def release(self, collect: bool = False):
        """Return cached device memory (the largest configurations need most of the GPU); ``collect`` also runs
        the garbage collector, which costs a good fraction of a second with torch loaded (once per configuration).
        """
        if collect:
            gc.collect()
        if self.gpu:
            import torch

            torch.cuda.empty_cache()

    def add(self, record: dict) -> dict:
        self.records.append(record)
        return record

    def payload(self) -> dict:
        return {"workload": self.workload, "title": self.title, "command": self.command, "quick": self.quick,
                "dry_run": self.dry_run, "samples": self.samples, "warmup": self.warmup,
                "elapsed_s": round(time.time() - self.started, 1), "environment": self.environment,
                "ceilings": self.ceilings, "records": self.records}

    def write(self) -> Path | None:
        """Write ``<results>/<workload>.json`` atomically (nothing for a dry run without ``--results``)."""
        if self.results_dir is None:
            return None
        return write_json(Path(self.results_dir) / f"{self.workload}.json", self.payload())

    def finish(self, table=None) -> Path | None:
        """Write the JSON and print ``table(records)`` (default :func:`summary_table`): a remote run shows its end."""
        path = self.write()
        print((table or summary_table)(self.records), flush=True)
        if path is not None:
            print(f"wrote {path}", flush=True)
        return path

    # -- measuring --
    def _note(self, text):
        bar = getattr(self, "_bar", None)
        if bar is not None:
            bar.note(text)

    def _build(self, config: dict, impl: str, build, needs_cuda: bool, **fields):
        """``(record, fn)``: ``impl``'s record begun (with ``fields``) and ``fn = build()``. ``fn`` is None when the
        record is already final: ``impl`` filtered out (record None), or unavailable here, or failing to build
        (recorded, and the suite goes on)."""
        if not self.selected(impl):
            return None, None
        self._note(impl)
        rec = {"config": dict(config), "impl": impl, "status": "ok", **fields}
        if needs_cuda and not self.gpu:
            return self.add({**rec, "status": "unavailable", "reason": "needs a CUDA GPU (dry run on the CPU)"}), None
        try:
            return rec, build()
        except (Unavailable, ImportError, ba.BackendError) as exc:
            return self.add({**rec, "status": "unavailable", "reason": _short(exc)}), None
        except Exception as exc:  # a baseline that fails to build must not stop the suite
            return self.add({**rec, "status": "error", "stage": "build", "reason": _short(exc),
                             "traceback": traceback.format_exc(limit=6)}), None

    def measure(self, config: dict, impl: str, build, *, shape, rows, expected, dtype: str, bytes_needed=None,
                flops=None, graph=True, view=None, out=None, needs_cuda=False) -> dict | None:
        """Build, check, then time ``impl`` on one configuration; returns the record (None if filtered out).

        Parameters
        ----------
        build : callable
            ``build() -> fn``; ``fn()`` runs one call and returns its output. Raise :class:`Unavailable` when
            the implementation cannot run here. Everything done in ``build`` (plans, copies the baseline is
            given ready) is outside the timed region.
        shape : tuple
            ``(nnz_qo, num_qo_heads, head_dim)``: the output is reshaped to it (after ``view``) to be checked.
        rows, expected : ``[n]`` and ``[n, num_qo_heads, head_dim]``
            Query rows checked and their float64 reference (:func:`reference_rows`).
        dtype : str
            Key of the tolerance table (the query dtype, or the fp8 KV dtype).
        bytes_needed, flops : int, optional
            The work's true cost, for the bound.
        graph : bool or str
            False or a reason string: time eager only.
        view : callable, optional
            Output to canonical layout, applied outside the timed region.
        out : tensor, optional
            The output buffer ``fn`` writes into; filled with NaN before each checked run.
        needs_cuda : bool
            Recorded as unavailable in a dry run on the CPU.
        """
        rec, fn = self._build(config, impl, build, needs_cuda, bytes=bytes_needed, flops=flops,
                              **bound(self.ceilings, bytes_needed, flops))
        if fn is None:
            return rec
        checking = dict(shape=shape, rows=rows, expected=expected, dtype=dtype, view=view)
        stage = "check"
        try:
            if out is not None:
                _fill_nan(out)
            if self.gpu:
                _poison_allocator(int(np.prod(shape)) * 4)
            y = fn()
            rec["check"] = check_output(y, **checking)
            del y
            if not rec["check"]["ok"]:
                return self.add({**rec, "status": "incorrect", "reason": rec["check"]["message"]})
            if not self.gpu:
                return self.add(rec)
            stage = "eager"
            rec["eager"] = self._time_eager(fn)
        except Exception as exc:
            self._recover()
            return self.add({**rec, "status": "error", "stage": stage, "reason": _short(exc),
                             "traceback": traceback.format_exc(limit=6)})
        if graph is not True:
            rec["graph"] = {"skipped": graph or "not capturable"}
        else:
            try:
                rec["graph"] = self._time_graph(fn, checking, rec)
            except Exception as exc:  # a call that cannot be captured keeps its eager figure
                self._recover()
                rec["graph"] = {"error": _short(exc)}
            if not rec.get("check_graph", {"ok": True})["ok"]:
                rec.update(status="incorrect", reason="graph replay: " + rec["check_graph"]["message"])
        del fn
        self.release()
        best = rec["graph"].get("median_us") or rec["eager"]["median_us"]
        rec["time_us"] = best
        rec["time_mode"] = "graph" if rec["graph"].get("median_us") else "eager"
        if "bound_us" in rec:
            rec["fraction"] = rec["bound_us"] / best
        if bytes_needed is not None:
            rec["tb_per_s"] = bytes_needed / best * 1e-6
        if flops is not None:
            rec["tflop_per_s"] = flops / best * 1e-6
        return self.add(rec)

    def _recover(self):
        import torch

        if self.gpu:
            try:
                torch.cuda.synchronize()
            except Exception as exc:
                print(f"{self.workload}: the CUDA context is unusable after an error ({_short(exc)})", file=sys.stderr)

    def _time_eager(self, fn) -> dict:
        import torch

        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.samples)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.samples)]
        for i in range(self.samples):
            self._flush.zero_()
            # The GPU is idle when the start event is recorded, so the interval includes the Python call.
            torch.cuda.synchronize()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return stats([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)])

    def _time_graph(self, fn, checking, rec) -> dict:
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = fn()
        _fill_nan(y)
        graph.replay()
        torch.cuda.synchronize()
        rec["check_graph"] = check_output(y, **checking)
        if not rec["check_graph"]["ok"]:
            return {"error": "replay output differs from the reference"}
        for _ in range(self.warmup):
            graph.replay()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.samples)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.samples)]
        for i in range(self.samples):
            self._flush.zero_()
            starts[i].record()
            graph.replay()
            ends[i].record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
        del graph, y
        return stats(times)

    def measure_host(self, config: dict, impl: str, build, *, samples=None, needs_cuda=False) -> dict | None:
        """Host wall time of ``fn()`` (``build() -> fn``), with a device synchronize so copies are counted."""
        rec, fn = self._build(config, impl, build, needs_cuda)
        if fn is None:
            return rec
        sync = _synchronize if self.gpu else (lambda: None)
        n = samples or self.samples
        try:
            for _ in range(min(self.warmup, 5) if self.dry_run else self.warmup):
                fn()
            sync()
            times = []
            for _ in range(3 if self.dry_run else n):
                t0 = time.perf_counter_ns()
                fn()
                sync()
                times.append((time.perf_counter_ns() - t0) / 1e3)
        except Exception as exc:
            self._recover()
            return self.add({**rec, "status": "error", "stage": "host", "reason": _short(exc),
                             "traceback": traceback.format_exc(limit=6)})
        rec["host"] = stats(times)
        rec["time_us"] = rec["host"]["median_us"]
        rec["time_mode"] = "host"
        return self.add(rec)


# ---- output -----------------------------------------------------------------------------------------------
def _jsonable(x):
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def write_json(path: Path, payload: dict) -> Path:
    """Write ``payload`` to ``path`` through a temporary file, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=_jsonable, allow_nan=True) + "\n")
    tmp.replace(path)
    return path


def load_results(results_dir=RESULTS_DIR) -> dict:
    """``{workload: payload}`` for every ``*.json`` in ``results_dir``."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("*.json"))}


def config_label(config: dict) -> str:
    """A short text for a configuration: ``"seq_len=4096 budget=64"``."""
    return " ".join(f"{k}={v}" for k, v in config.items())


def _cell(x) -> str:
    return f"{x:9.1f}" if isinstance(x, (int, float)) else f"{'-':>9}"


def summary_table(records) -> str:
    """A plain text table of records, printed at the end of each script."""
    lines = [f"{'config':46} {'impl':26} {'graph µs':>9} {'eager µs':>9} {'bound µs':>9} {'frac':>6}  status"]
    for r in records:
        g = r.get("graph", {}).get("median_us") if isinstance(r.get("graph"), dict) else None
        e = r.get("eager", {}).get("median_us") if isinstance(r.get("eager"), dict) else None
        if r.get("host"):
            e = r["host"]["median_us"]
        frac = f"{r['fraction']:6.2f}" if "fraction" in r else f"{'-':>6}"
        status = r["status"] + (f": {r['reason'][:60]}" if r.get("reason") else "")
        lines.append(f"{config_label(r['config'])[:46]:46} {r['impl'][:26]:26} {_cell(g)} {_cell(e)} "
                     f"{_cell(r.get('bound_us'))} {frac}  {status}")
    return "\n".join(lines)
