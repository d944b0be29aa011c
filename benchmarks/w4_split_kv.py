"""Workload 4: variable-length decode, the scheduler on vs off.

kv_len ~ U(4096, 16384) per request, batch {1, 8, 32, 256}; 32 query / 8 KV heads, head_dim 128, fp16, page 16,
scattered pages (the pool and checks of workload 2). The planned kernel (split-KV chunks, longest first, least
loaded CTA: FlashInfer's Algorithm 1 in ``bsrattn.scheduler``) against one CTA per request
(``disable_split_kv=True``). With few requests the unsplit kernel leaves most SMs idle, so the planned one should
win by several times at batch 1 and tie once the batch fills the GPU.

Implementations, each checked against the float64 reference, then timed in graph and eager mode:

- ``bsrattn-torch`` (planned), ``bsrattn-torch-no-split``, and ``bsrattn-torch-deterministic`` (the planned call in
  deterministic mode at its default ``split_size``: what partition invariance costs);
- ``flashinfer-tensor-core`` and ``flashinfer-tensor-core-no-split`` (its ``disable_split_kv``), and in the full
  run ``flashinfer-cuda-core``.

The report gives each pair's speedup, ``<name>-no-split`` time / ``<name>`` time, and deterministic mode's cost,
``<name>-deterministic`` time / ``<name>`` time (FlashInfer's way to the same invariance is its no-split mode).

Run: ``python3 -m benchmarks.w4_split_kv [--quick]``.
"""

from __future__ import annotations

from functools import partial

from benchmarks import harness
from benchmarks.w2_paged_decode import (DRY_SHAPE, GPU_SHAPE, build_flashinfer, kv_lengths, make_case,
                                        measure_bsrattn)

WORKLOAD = "w4_split_kv"
TITLE = "W4: variable-length decode, split-KV scheduler on vs off (kv ~ U(4096,16384), 32/8 heads, d128, fp16)"
KV = "U(4096,16384)"
BATCHES = (1, 8, 32, 256)
QUICK = BATCHES  # batch 256 too: deterministic mode's cost is judged at batch 1 and from batch 32 on


def run(suite) -> None:
    shape = DRY_SHAPE if suite.dry_run else GPU_SHAPE
    kv = "U(16,64)" if suite.dry_run else KV
    items = (1, 3) if suite.dry_run else (QUICK if suite.quick else BATCHES)
    for batch, config in suite.configs(items, lambda b: {"batch": b, "kv_len": kv}):
        case = make_case(suite, shape, "float16", kv_lengths(suite.rng, batch, kv))
        tier = "reference" if suite.dry_run else "torch"
        measure_bsrattn(suite, config, case, tier)
        measure_bsrattn(suite, config, case, tier, name=f"bsrattn-{tier}-no-split", disable_split_kv=True)
        measure_bsrattn(suite, config, case, tier, name=f"bsrattn-{tier}-deterministic", deterministic=True)
        suite.measure(config, "flashinfer-tensor-core", partial(build_flashinfer, case, tensor_cores=True),
                      out=case.out, needs_cuda=True, **case.check_args())
        suite.measure(config, "flashinfer-tensor-core-no-split",
                      partial(build_flashinfer, case, tensor_cores=True, disable_split_kv=True), out=case.out,
                      needs_cuda=True, **case.check_args())
        if not suite.quick:
            suite.measure(config, "flashinfer-cuda-core", partial(build_flashinfer, case, tensor_cores=False),
                          out=case.out, needs_cuda=True, **case.check_args())
        del case


def main(argv=None):
    harness.run_script(WORKLOAD, TITLE, run, __doc__, argv)


if __name__ == "__main__":
    main()
