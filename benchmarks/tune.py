"""Tile and schedule sweep for the torch tier: which tiles, pipeline depth, CTAs per SM and split floor win.

The tuning ladder of ``benchmarks/NOTES.md`` is measured with this script. Decode is memory-bound: what
matters is how many bytes are in flight per SM (tile width x pipeline depth x CTAs per SM) and how finely
the plan splits the KV (more items fill the GPU; each item costs a prologue and a merge). Prefill is
FLOP-bound: what matters is the tile shape the tensor cores see and how evenly the causal work spreads over
the SMs (more CTAs than SMs lets the hardware balance what the static plan cannot). MLA decode (W11) is
FLOP-bound with a 576-wide key and a 512-wide value: what matters is which tile of query heads x keys fits the
registers, and whether the 64-row tiles that reach ``wgmma`` but spill beat the 32-row tile that does not.

Each point is a :meth:`harness.Suite.measure` of ``bsrattn-torch`` (correctness against the float64 reference
first, then eager and graph timing, L2 flushed before every sample) with the configuration's knobs set in
:mod:`bsrattn.torch_cuda.config` for the duration of the plan and the run. Writes
``benchmarks/results/tune.json`` and prints the best point per case.

Run on the GPU: ``python3 -m benchmarks.tune [--samples 50] [--impls ...]``; ``--cases w1,w3`` picks cases
(``--cases w11`` the MLA sweep).
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import replace

import bsrattn as ba
from benchmarks import harness, w1_quest_decode as w1, w2_paged_decode as w2, w3_prefill as w3, w11_mla_decode as w11
from bsrattn.torch_cuda import config as cfg, item_kernel

WORKLOAD = "tune"
TITLE = "torch tier tile and schedule sweep"
DECODE = dict(block_n=(32, 64), warps=(4, 8), stages=(2, 3, 4), ctas_per_sm=(1, 2), min_split=(256,))
PREFILL = [dict(kernel=kernel, block_m=128, block_n=n, warps=8, stages=stages, ctas_per_sm=4)
           for kernel, n, stages in (("persistent", 64, 3), ("items, gathered", 64, 3), ("items", 64, 2),
                                     ("items", 64, 3), ("items", 128, 3))]
"""Prefill points: the persistent kernel, and the item kernel (``item_kernel.py``) reading affine rows with gathered
loads or, as shipped, through tensor descriptors."""
MLA = [dict(max_rows=rows, block_n=n, warps=8, stages=stages, ctas_per_sm=ctas, min_split=split, decode_rows=group)
       for rows, n, stages, ctas, split, group in (
           (64, 64, 2, 2, 256, 64), (64, 64, 2, 1, 256, 64), (64, 64, 2, 2, 128, 64), (64, 64, 2, 2, 512, 64),
           (64, 32, 2, 2, 256, 64), (32, 16, 2, 2, 256, 64), (32, 16, 2, 2, 256, 32), (32, 64, 2, 2, 256, 32))]
"""MLA decode points (128 heads over one latent head, run in head groups of ``decode_rows`` heads:
``config.head_groups``): the shipped 64 x 64 tile (``wgmma``, which spills) on one or two CTAs an SM, with shorter
and longer chunks; a 64 x 32 tile; the 32 x 16 ``mma.sync`` tile that spills nothing, in groups of 64 and of 32
heads (the fastest at batch 1); and groups of 32 heads on 32 x 64 tiles (``benchmarks/NOTES.md``, MLA decode)."""
CASES = {
    "w1": [("decode", f"W1 quest {n}/{b}", lambda s, n=n, b=b: w1.make_case(s, n, b, w1.GPU_SHAPE))
           for n, b in ((32768, 64), (32768, 512))],
    "w2": [("decode", f"W2 paged {b}x{n}", lambda s, b=b, n=n: w2.make_case(s, w2.GPU_SHAPE, "float16", [n] * b))
           for b, n in ((1, 1024), (16, 4096), (256, 16384))],
    "w2-small": [("decode", f"W2 paged {b}x{n}",
                  lambda s, b=b, n=n: w2.make_case(s, w2.GPU_SHAPE, "float16", [n] * b))
                 for b, n in ((1, 16384), (4, 8192), (16, 4096))],
    "w3": [("prefill", f"W3 prefill {w3.label(spec)}",
            lambda s, spec=spec: w3.make_case(s, w3.GPU_SHAPE, w3.lengths(s.rng, spec), "ragged"))
           for spec in (("const", 16, 1024), ("uniform", 16, 256, 1792), ("const", 1, 8192))],
    "w3-paged": [("prefill", f"W3 prefill 16 x 1024 paged {page}",
                  lambda s, page=page: w3.make_case(s, replace(w3.GPU_SHAPE, page_size=page), [1024] * 16, "paged"))
                 for page in (16, 1)],
    "w11": [("mla", f"W11 MLA {b} x {n}, page 64",
             lambda s, b=b, n=n: w11.make_case(s, w11.GPU_SHAPE, "bfloat16", 64, [n] * b))
            for b, n in ((1, 4096), (32, 4096), (128, 4096))],
}
DRY_CASES = [("decode", "W1 dry", lambda s: w1.make_case(s, 256, 8, w1.DRY_SHAPE)),
             ("decode", "W2 dry", lambda s: w2.make_case(s, w2.DRY_SHAPE, "float16", [40, 9])),
             ("prefill", "W3 dry", lambda s: w3.make_case(s, w3.DRY_SHAPE, [24, 7], "ragged")),
             ("mla", "W11 dry", lambda s: w11.make_case(s, w11.DRY_SHAPE, "float16", 4, [30, 9]))]
"""A dry run (``--dry-run``, the CPU, tiny shapes) checks one point of each sweep on these: the plumbing only."""


@contextlib.contextmanager
def knobs(kind, block_n, warps, stages, ctas_per_sm, min_split=None, block_m=None, kernel=None, max_rows=None,
          decode_rows=None):
    """Set the tier's tile and schedule choices for ``kind`` ("decode", "prefill" or "mla", which plans as a decode),
    restored on exit; ``max_rows`` caps the tile's rows below the plan's (an item loops over row sub-tiles), and
    ``decode_rows`` sets ``config.DECODE_ROWS`` (MLA's head groups hold that many heads)."""
    saved = (cfg.tiles, dict(cfg.CTAS_PER_SM), cfg.DECODE_MIN_SPLIT, cfg.PREFILL_BLOCK_M, cfg.item_kernel_for,
             item_kernel.tma_ready, cfg.DECODE_ROWS)
    cfg.tiles = lambda m, head_dim, dtype, few_items=False, **widths: cfg.Tiles(min(m, max_rows or m), block_n, warps,
                                                                                stages)
    cfg.CTAS_PER_SM["prefill" if kind == "prefill" else "decode"] = ctas_per_sm
    cfg.DECODE_MIN_SPLIT = min_split or cfg.DECODE_MIN_SPLIT
    cfg.PREFILL_BLOCK_M = block_m or cfg.PREFILL_BLOCK_M
    cfg.DECODE_ROWS = decode_rows or cfg.DECODE_ROWS
    if kernel == "persistent":
        cfg.item_kernel_for = lambda *args: 0
    elif kernel == "items, gathered":
        item_kernel.tma_ready = lambda *args: False
    try:
        yield
    finally:
        cfg.tiles, cfg.DECODE_MIN_SPLIT, cfg.PREFILL_BLOCK_M, cfg.item_kernel_for = saved[0], *saved[2:5]
        item_kernel.tma_ready, cfg.DECODE_ROWS = saved[5:]
        cfg.CTAS_PER_SM.update(saved[1])


def measure(suite, config, case):
    """One point of ``bsrattn-torch``: W1 runs on its per-head views, W2, W3 and W11 on their layouts."""
    if isinstance(case, w1.Case):
        d = case.shape.head_dim
        harness.measure_bsrattn(suite, config, "bsrattn-torch", "torch", case.layout, *case.views,
                                plan=dict(num_qo_heads=1, num_kv_heads=1, head_dim=d, q_dtype="float16",
                                          kv_dtype="float16"),
                                out=case.out, shape=(case.shape.heads, 1, d), rows=case.rows,
                                expected=case.expected, dtype="float16", bytes_needed=case.bytes_needed)
    elif isinstance(case, w2.Case):
        w2.measure_bsrattn(suite, config, case, "torch")
    elif isinstance(case, w11.Case):
        w11.measure_bsrattn(suite, config, case, "torch")
    else:
        s = case.shape
        harness.measure_bsrattn(suite, config, "bsrattn-torch", "torch", case.layout, case.q, case.k, case.v,
                                plan=dict(num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads,
                                          head_dim=s.head_dim, variant=ba.Variant(causal=True), q_dtype=s.dtype,
                                          kv_dtype=s.dtype),
                                out=case.out, **case.check_args())


def run(suite, cases) -> None:
    for kind, name, make in cases:
        case = make(suite)
        if kind == "decode":
            points = [dict(zip(DECODE, values)) for values in itertools.product(*DECODE.values())]
        else:
            points = MLA if kind == "mla" else PREFILL
        points = points[:1] if suite.dry_run else points
        for point, config in suite.configs(points, lambda p, name=name: {"case": name, **p}):
            with knobs(kind, **point):
                measure(suite, config, case)
        best = min((r for r in suite.records if r["config"].get("case") == name and "time_us" in r),
                   key=lambda r: r["time_us"], default=None)
        if best is not None:
            print(f"{name}: best {best['time_us']:.1f} us ({best.get('fraction', 0):.2f} of the bound) at "
                  f"{ {k: v for k, v in best['config'].items() if k != 'case'} }", flush=True)
        del case


def main(argv=None):
    p = harness.parser(__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="w1,w2,w3", help=f"comma-separated, from {sorted(CASES)}")
    args = p.parse_args(argv)
    suite = harness.Suite(WORKLOAD, TITLE, args)
    run(suite, DRY_CASES if suite.dry_run else [c for key in args.cases.split(",") for c in CASES[key.strip()]])
    suite.finish()


if __name__ == "__main__":
    main()
