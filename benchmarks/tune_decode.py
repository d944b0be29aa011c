"""Decode tile sweep for the torch tier: which (BLOCK_N, warps, stages, CTAs per SM, minimum split) is fastest.

The first step of the tuning ladder in ``benchmarks/NOTES.md``: the kernel is memory-bound at decode, so the
knobs that matter are how many bytes are in flight per SM (tile width x pipeline depth x CTAs per SM) and how
finely the plan splits the KV (more items fill the GPU, each item costs a fixed prologue and a merge).

Every configuration is checked against the float64 reference (output poisoned with NaN first), then timed in
graph mode: a CUDA graph of ``BatchAttention.run`` replayed, the L2 flushed (256 MiB zeroed) before every
sample, CUDA events, median of ``--samples``. Writes ``benchmarks/results/tune_decode.json``.

Run on the GPU: ``python3 benchmarks/tune_decode.py [--samples 100]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import bsrattn as ba  # noqa: E402
from bsrattn.testing import assert_close  # noqa: E402
from bsrattn.torch_cuda import config as cfg  # noqa: E402

COPY_BANDWIDTH = 4.16e12  # bytes/s read + written, measured on the H200 (BENCHMARKS.md)
RESULTS = Path(__file__).resolve().parent / "results" / "tune_decode.json"


def quest_case(rng, seq_len, budget, heads=32, head_dim=128, page=16):
    """W1: one request, every head keeps ``budget`` random sorted pages of a scattered HND cache."""
    pages = seq_len // page
    table = rng.permutation(pages)
    selected = [[np.sort(rng.choice(pages, budget, replace=False)) for _ in range(heads)]]
    layout = ba.layouts.quest([table], [seq_len], selected, page, pages, heads)
    q = torch.randn(1, heads, head_dim, device="cuda", dtype=torch.float16)
    k = torch.randn(pages, heads, page, head_dim, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    q, k, v = ba.layouts.per_head_views(q, k, v, heads)
    needed = heads * budget * page * head_dim * 2 * 2 + 2 * q.numel() * 2
    return f"W1 quest {seq_len}/{budget}", layout, q, k, v, needed


def paged_case(rng, batch, kv_len, qo_heads=32, kv_heads=8, head_dim=128, page=16):
    """W2: ``batch`` decode requests of ``kv_len`` tokens, pages scattered at random."""
    n = -(-kv_len // page)
    pool = rng.permutation(batch * n)
    layout = ba.layouts.paged(np.ones(batch, int), pool.reshape(batch, n), np.full(batch, kv_len), page, batch * n)
    q = torch.randn(batch, qo_heads, head_dim, device="cuda", dtype=torch.float16)
    k = torch.randn(batch * n, page, kv_heads, head_dim, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    needed = batch * kv_len * kv_heads * head_dim * 2 * 2 + 2 * q.numel() * 2
    return f"W2 paged {batch}x{kv_len}", layout, q, k, v, needed


def check(attn, layout, q, k, v):
    out = torch.full_like(q, float("nan"))
    attn.run(q, k, v, out=out)
    rows = np.random.default_rng(0).choice(q.shape[0], min(4, q.shape[0]), replace=False)
    sub = ba.layouts.vector_sparse([layout.kv_slots(int(r)) for r in rows], [1] * len(rows), layout.num_slots)
    kk = k.reshape(layout.num_slots, -1, k.shape[-1]).double().cpu().numpy()
    vv = v.reshape(layout.num_slots, -1, v.shape[-1]).double().cpu().numpy()
    expect = ba.attention(q[rows].double().cpu().numpy(), kk, vv, sub)
    assert_close(out[rows], expect, "attention", "float16")


def time_graph(attn, q, k, v, samples):
    out = torch.empty_like(q)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            attn.run(q, k, v, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q, k, v, out=out)
    times = []
    for _ in range(samples + 10):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[10:])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=100)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    cases = [quest_case(rng, 32768, 64), quest_case(rng, 32768, 512), paged_case(rng, 1, 1024),
             paged_case(rng, 16, 4096), paged_case(rng, 64, 4096)]
    sweep = list(itertools.product((32, 64, 128), (4, 8), (2, 3), (1, 2, 4), (1, 256)))
    base_tiles, base_ctas = cfg.tiles, dict(cfg.CTAS_PER_SM)
    records = []
    for name, layout, q, k, v, needed in cases:
        bound_us = needed / COPY_BANDWIDTH * 1e6
        best = None
        for block_n, warps, stages, per_sm, min_split in sweep:
            cfg.tiles = lambda m, d, dt, _n=block_n, _w=warps, _s=stages: cfg.Tiles(m, _n, _w, _s)
            cfg.CTAS_PER_SM["decode"] = per_sm
            attn = ba.BatchAttention(backend="torch")
            heads = (q.shape[1], k.shape[-2], q.shape[-1])
            try:
                attn.plan(layout, *heads)
                if min_split > 1:
                    chunk = max(min_split, attn.work_plans[0].kv_chunk_size)
                    attn.plan(layout, *heads, fixed_split_size=-(-chunk // block_n) * block_n)
                check(attn, layout, q, k, v)
                us = time_graph(attn, q, k, v, args.samples)
            except Exception as exc:  # a configuration the compiler or the GPU refuses is recorded, not fatal
                records.append(dict(case=name, block_n=block_n, warps=warps, stages=stages, ctas_per_sm=per_sm,
                                    min_split=min_split, error=f"{type(exc).__name__}: {exc}"[:300]))
                continue
            rec = dict(case=name, block_n=block_n, warps=warps, stages=stages, ctas_per_sm=per_sm,
                       min_split=min_split, us=us, bound_us=bound_us, x_bound=us / bound_us)
            records.append(rec)
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), records=records), indent=1))
            if best is None or us < best["us"]:
                best = rec
        print(f"{name:22s} bound {bound_us:6.1f} us  best {best['us']:6.1f} us ({best['x_bound']:.2f}x): "
              f"BLOCK_N {best['block_n']}, warps {best['warps']}, stages {best['stages']}, "
              f"{best['ctas_per_sm']} CTAs/SM, min split {best['min_split']}", flush=True)
    cfg.tiles = base_tiles
    cfg.CTAS_PER_SM.update(base_ctas)


if __name__ == "__main__":
    main()
