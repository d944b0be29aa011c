"""The torch tier on a GPU: a memcheck run, and first timings of workload 1 (docs/benchmarks.md) beside SDPA.

Usage (on the H200)::

    python3 tests/gpu_torch_check.py                  # W1 timings at seq_len 32768, budgets 64 and 512
    compute-sanitizer --tool memcheck python3 tests/gpu_torch_check.py --memcheck

``--memcheck`` runs one representative paged decode (split plan, merges folded into the kernel) and one
ragged causal prefill, each checked against the float64 reference, and nothing else, so that
compute-sanitizer's report covers exactly the tier's kernels.

The timing follows the suite's method (benchmarks/README.md): correctness first (outputs poisoned with NaN, then compared with the
float64 reference), graph mode (the call captured in a CUDA graph and replayed), L2 flushed by zeroing a
256 MiB buffer before each sample, CUDA events, the median of ``--samples`` samples after warm-up. SDPA with a
boolean mask over the whole cache (a ready contiguous copy) is measured in the same run on the same data.
The bound is the bytes the work needs over the 4.16 TB/s copy bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import bsrattn as ba  # noqa: E402
from bsrattn.testing import assert_close, scattered_page_tables  # noqa: E402

COPY_BANDWIDTH = 4.16e12  # bytes/s, the H200's measured device-to-device copy rate
HEADS, HEAD_DIM, PAGE = 32, 128, 16


def _f64(x):
    return x.detach().double().cpu().numpy()


def _reference(q, k, v, layout, variant=None, kv_layout="NHD"):
    return ba.attention(_f64(q), _f64(k), _f64(v), layout, variant=variant, kv_layout=kv_layout,
                        backend="reference", return_lse=True)


def memcheck():
    """One paged decode and one ragged causal prefill, each checked; small enough for compute-sanitizer."""
    rng = np.random.default_rng(0)
    hq, hkv = 32, 8
    kv_lens = [1900, 37, 800, 1200]
    tables, num_pages = scattered_page_tables(rng, kv_lens, PAGE, spare_pages=5)
    layout = ba.layouts.paged([1] * 4, tables, kv_lens, PAGE, num_pages)
    q = torch.randn(4, hq, HEAD_DIM, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(num_pages, PAGE, hkv, HEAD_DIM, device="cuda", dtype=torch.float16) for _ in range(2))
    attn = ba.BatchAttention(backend="torch")
    attn.plan(layout, hq, hkv, HEAD_DIM, q_dtype="float16", kv_dtype="float16")
    out, lse = attn.run(q, k, v, return_lse=True)
    want = _reference(q, k, v, layout)
    assert_close(out, want[0], "attention", "float16", name="paged decode out")
    assert_close(lse, want[1], "lse", "float16", name="paged decode lse")
    print(f"paged decode ok ({attn.work_plans[0].num_merges} merges in the kernel)")

    ragged = ba.layouts.ragged([300, 129], [400, 129])
    q = torch.randn(ragged.nnz_qo, hq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(ragged.num_blocks, hkv, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    variant = ba.Variant(causal=True)
    out, lse = ba.attention(q, k, v, ragged, variant=variant, backend="torch", return_lse=True)
    want = _reference(q, k, v, ragged, variant)
    assert_close(out, want[0], "attention", "bfloat16", name="ragged prefill out")
    assert_close(lse, want[1], "lse", "bfloat16", name="ragged prefill lse")
    print("ragged causal prefill ok")


def graph_time_us(fn, flush, samples, warmup=20):
    """Median GPU time (µs) of ``fn`` captured in a CUDA graph and replayed, L2 flushed before each sample."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(samples)]
    for start, end in events:
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return 1000 * statistics.median(s.elapsed_time(e) for s, e in events)


def eager_time_us(fn, flush, samples, warmup=20):
    """Median time (µs) of ``fn`` called from Python (host overhead included), L2 flushed before each sample."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(samples)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return 1000 * statistics.median(s.elapsed_time(e) for s, e in events)


def workload1(seq_len, budget, samples, flush, rng):
    """W1 at one (seq_len, budget): bsrattn (graph and eager) and SDPA with a mask; returns a table row."""
    n_pages = seq_len // PAGE
    table = rng.permutation(n_pages)
    selected = np.sort(np.stack([rng.choice(n_pages, budget, replace=False) for _ in range(HEADS)]), axis=1)
    kw = dict(dtype=torch.float16, device="cuda")
    q = torch.randn(1, HEADS, HEAD_DIM, **kw)
    k, v = (torch.randn(n_pages, HEADS, PAGE, HEAD_DIM, **kw) for _ in range(2))
    layout = ba.layouts.quest([table], [seq_len], [selected], PAGE, n_pages, HEADS)
    qv, kv, vv = ba.layouts.per_head_views(q, k, v, HEADS)
    attn = ba.BatchAttention(backend="torch")
    attn.plan(layout, 1, 1, HEAD_DIM, q_dtype="float16", kv_dtype="float16")
    out = torch.full_like(qv, float("nan"))
    attn.run(qv, kv, vv, out=out)
    want_o, _ = _reference(qv, kv, vv, layout)
    assert_close(out, want_o, "attention", "float16", name=f"bsrattn W1 {seq_len}/{budget}")

    # SDPA over the whole cache in logical order (a ready contiguous copy), selected tokens masked in.
    order = torch.as_tensor(table, device="cuda")
    kc, vc = (x[order].permute(1, 0, 2, 3).reshape(1, HEADS, seq_len, HEAD_DIM).contiguous() for x in (k, v))
    tokens = torch.as_tensor((selected[:, :, None] * PAGE + np.arange(PAGE)).reshape(HEADS, -1), device="cuda")
    mask = torch.zeros(HEADS, seq_len, dtype=torch.bool, device="cuda")
    mask[torch.arange(HEADS, device="cuda")[:, None], tokens] = True
    q4, mask4 = q.reshape(1, HEADS, 1, HEAD_DIM), mask[None, :, None, :]
    sdpa_out = torch.full((1, HEADS, 1, HEAD_DIM), float("nan"), **kw)

    def sdpa():
        sdpa_out.copy_(F.scaled_dot_product_attention(q4, kc, vc, attn_mask=mask4))

    sdpa()
    assert_close(sdpa_out.reshape(HEADS, 1, HEAD_DIM), want_o, "attention", "float16", name="SDPA W1")

    needed = HEADS * budget * PAGE * HEAD_DIM * 2 * 2 + 2 * HEADS * HEAD_DIM * 2 + HEADS * budget * 4
    plan = attn.work_plans[0]
    return dict(
        seq_len=seq_len, budget=budget, bytes=needed, bound_us=needed / COPY_BANDWIDTH * 1e6,
        graph_us=graph_time_us(lambda: attn.run(qv, kv, vv, out=out), flush, samples),
        eager_us=eager_time_us(lambda: attn.run(qv, kv, vv, out=out), flush, samples),
        sdpa_us=graph_time_us(sdpa, flush, samples),
        plan=f"{plan.num_ctas} CTAs, {plan.num_items} items, {plan.num_merges} merges, chunk {plan.kv_chunk_size}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memcheck", action="store_true", help="one checked decode + prefill, no timing")
    parser.add_argument("--samples", type=int, default=200, help="timed samples per figure (>= 100)")
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 512])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("gpu_torch_check.py needs a CUDA GPU")
    if args.memcheck:
        memcheck()
        return
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, samples {args.samples}; "
          f"W1: batch 1, {HEADS}/{HEADS} heads, d{HEAD_DIM}, fp16, page {PAGE}")
    header = ("seq_len", "budget", "MB needed", "bound us", "bsrattn graph us", "x bound", "bsrattn eager us",
              "SDPA+mask graph us", "plan")
    print(" | ".join(header))
    for budget in args.budgets:
        r = workload1(args.seq_len, budget, args.samples, flush, rng)
        print(" | ".join([str(r["seq_len"]), str(r["budget"]), f"{r['bytes'] / 1e6:.1f}", f"{r['bound_us']:.1f}",
                          f"{r['graph_us']:.1f}", f"{r['graph_us'] / r['bound_us']:.2f}", f"{r['eager_us']:.1f}",
                          f"{r['sdpa_us']:.1f}", r["plan"]]))


if __name__ == "__main__":
    main()
