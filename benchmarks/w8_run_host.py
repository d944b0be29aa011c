"""Workload 8: host cost of one call, what a model that does not capture CUDA graphs pays per attention call.

Decode (batch 1 x kv 1024, 16 x 4096; fp16, page 16, scattered pages) and causal ragged prefill (1 x 1024,
4 x 512; bf16); 32 query / 8 KV heads, head_dim 128. Every implementation is checked against the float64
reference first, then timed three ways:

- ``host``, the figure: the host time per call of a tight loop of 20 calls, no flush and no synchronize
  between them (``timing.time_host_loop``), so it is what each call costs the CPU while the GPU queue absorbs
  the kernels. Where it exceeds the GPU time, a model's decode step is bound by it.
- ``eager``: the suite's eager mode, one call after an L2 flush and a synchronize, bracketed by CUDA events:
  the host's launch cost plus the GPU time, as one isolated call sees it.
- ``queued``: the call's GPU time alone, each call queued behind a spin kernel that hides its host cost
  (``timing.time_queued``), beside which the host figure says whether the host or the GPU bounds a step.

Implementations:

- ``bsrattn-torch``: ``BatchAttention.run`` on a plan made outside the loop (one ``plan`` per generation step
  serves every layer of a model);
- ``bsrattn-torch-oneshot``: ``ba.attention`` with the same layout object every call, as a model's layers call
  it in one step (the torch tier runs the last call's plan again for a call of the same spec);
- ``bsrattn-torch-oneshot-replan``: ``ba.attention`` on two layout objects of the same rows in turn, so that
  every call plans;
- ``bsrattn-numba``: ``BatchAttention.run`` on the numba tier, at decode (it takes no bfloat16 device arrays);
- ``flashinfer-cuda-core``: ``BatchDecodeWithPagedKVCacheWrapper.run``; ``flashinfer-fa2``:
  ``BatchPrefillWithRaggedKVCacheWrapper.run``; each planned outside the loop, as ``bsrattn-torch``.

Run: ``python3 -m benchmarks.w8_run_host [--quick]``.
"""

from __future__ import annotations

import copy
import itertools
from functools import partial

import bsrattn as ba
from benchmarks import harness, w2_paged_decode, w3_prefill

WORKLOAD = "w8_run_host"
TITLE = "W8: host time per call, tight loop (32/8 heads, d128; decode fp16 page 16, causal prefill bf16)"
DECODE = ((1, 1024), (16, 4096))
PREFILL = ((1, 1024), (4, 512))
DRY_DECODE = ((2, 32),)
DRY_PREFILL = ((2, 24),)


def build_one_shot(tier, case, variant, scales, replan=False):
    """``ba.attention`` on ``case``'s tensors (NumPy copies for the reference tier): on ``case.layout`` every
    call, or with ``replan`` on it and a copy of it (another object, the same rows) in turn, which plans every
    call."""
    if tier == "reference":
        q, k, v = (x.detach().cpu().numpy() for x in (case.q, case.k, case.v))
        out = None
    else:
        q, k, v, out = case.q, case.k, case.v, case.out
    layouts = itertools.cycle((case.layout, copy.copy(case.layout)) if replan else (case.layout,))
    return lambda: ba.attention(q, k, v, next(layouts), variant=variant, out=out, backend=tier, **scales)


def measure_all(suite, config, case, plan, variant, scales, flashinfer):
    """Every implementation on one case: ``plan`` for ``BatchAttention.plan``, ``flashinfer`` its name and build."""
    import torch

    tiers = ("reference",) if suite.dry_run else ("torch", "numba") if case.q.dtype == torch.float16 else ("torch",)
    for tier in tiers:
        suite.measure(config, f"bsrattn-{tier}",
                      harness.bsrattn_build(tier, case.layout, case.q, case.k, case.v, plan=plan, out=case.out,
                                            run=scales),
                      out=case.out if tier != "reference" else None, graph="host-cost workload: calls from Python",
                      host_loop=True, **case.check_args())
    tier = tiers[0]
    for suffix, replan in (("oneshot", False), ("oneshot-replan", True)):
        suite.measure(config, f"bsrattn-{tier}-{suffix}", partial(build_one_shot, tier, case, variant, scales, replan),
                      out=case.out if tier != "reference" else None, graph="host-cost workload: calls from Python",
                      host_loop=True, **case.check_args())
    suite.measure(config, flashinfer[0], flashinfer[1], out=case.out, needs_cuda=True,
                  graph="host-cost workload: calls from Python", host_loop=True, **case.check_args())


def run(suite) -> None:
    decode_shape = w2_paged_decode.DRY_SHAPE if suite.dry_run else w2_paged_decode.GPU_SHAPE
    prefill_shape = w3_prefill.DRY_SHAPE if suite.dry_run else w3_prefill.GPU_SHAPE
    decode = DRY_DECODE if suite.dry_run else DECODE
    prefill = DRY_PREFILL if suite.dry_run else PREFILL
    items = [("decode", b, n) for b, n in decode] + [("prefill", b, n) for b, n in prefill]
    for (kind, batch, length), config in suite.configs(
            items, lambda c: {"kind": c[0], "batch": c[1], "kv_len": c[2]}):
        if kind == "decode":
            case = w2_paged_decode.make_case(suite, decode_shape, "float16",
                                             w2_paged_decode.kv_lengths(suite.rng, batch, length))
            measure_all(suite, config, case, case.plan_args(), None, case.scales,
                        ("flashinfer-cuda-core", partial(w2_paged_decode.build_flashinfer, case, tensor_cores=False)))
        else:
            s = prefill_shape
            case = w3_prefill.make_case(suite, s, [length] * batch, "ragged")
            variant = ba.Variant(causal=True)
            plan = dict(num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                        variant=variant, q_dtype=s.dtype, kv_dtype=s.dtype)
            measure_all(suite, config, case, plan, variant, {},
                        ("flashinfer-fa2", partial(w3_prefill.build_flashinfer, case, "fa2")))
        del case


def main(argv=None):
    harness.run_script(WORKLOAD, TITLE, run, __doc__, argv)


if __name__ == "__main__":
    main()
