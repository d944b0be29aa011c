"""A target for compute-sanitizer: a few representative calls of a GPU tier, each checked, and nothing else.

    compute-sanitizer --tool memcheck python3 tests/memcheck.py numba
    compute-sanitizer --tool memcheck python3 tests/memcheck.py torch

(with ``bsrattn`` installed, ``pip install -e .``, or on ``PYTHONPATH``).

Small shapes, so the sanitizer's report covers every kernel the tier launches in seconds: a paged decode and a
multi-row paged call with GQA 32/8 over scattered pages (split KV, so the merges run), HND storage, a ragged
causal prefill, and a Quest selection (one row per head). Each result is compared with the float64 reference
tier (the tolerance table of :mod:`bsrattn.testing`); a wrong answer exits non-zero. Timings are the
benchmark suite's (``benchmarks/``), not this script's.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import bsrattn as ba
from bsrattn.testing import scattered_page_tables
from helpers import assert_matches_reference  # this script's folder is on the path

PAGE, HEAD_DIM, HQ, HKV = 16, 128, 32, 8


def _case(backend, name, q, k, v, layout, **kwargs):
    got = ba.attention(q, k, v, layout, backend=backend, return_lse=True, **kwargs)
    assert_matches_reference(got, q, k, v, layout, "float16", name=name, **kwargs)
    print(f"{backend} {name}: matches the reference")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("backend", choices=("numba", "torch"))
    backend = parser.parse_args(argv).backend
    rng = np.random.default_rng(0)

    def randn(*shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(np.float16)

    kv_lens = np.array([1900, 37, 800, 1200, 1, 65])
    tables, num_pages = scattered_page_tables(rng, kv_lens, PAGE, spare_pages=5)
    k, v = randn(num_pages, PAGE, HKV, HEAD_DIM), randn(num_pages, PAGE, HKV, HEAD_DIM)
    decode = ba.layouts.paged([1] * 6, tables, kv_lens, PAGE, num_pages)
    _case(backend, "paged decode", randn(6, HQ, HEAD_DIM), k, v, decode)
    rows = ba.layouts.paged([3, 1, 7, 2, 1, 4], tables, kv_lens, PAGE, num_pages)
    _case(backend, "paged causal rows", randn(rows.nnz_qo, HQ, HEAD_DIM), k, v, rows, variant=ba.Variant(causal=True))
    hnd = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (k, v)]
    _case(backend, "paged decode, HND", randn(6, HQ, HEAD_DIM), *hnd, decode, kv_layout="HND")
    prefill = ba.layouts.ragged([300, 5, 129], [300, 700, 129])
    _case(backend, "ragged causal prefill", randn(prefill.nnz_qo, HQ, HEAD_DIM),
          randn(prefill.num_slots, HKV, HEAD_DIM), randn(prefill.num_slots, HKV, HEAD_DIM), prefill,
          variant=ba.Variant(causal=True))
    pages = 4096 // PAGE
    pool = [randn(pages, HQ, PAGE, HEAD_DIM) for _ in range(2)]  # HND: one (page, head) is contiguous
    selected = [np.sort(rng.choice(pages, 64, replace=False)) for _ in range(HQ)]
    quest = ba.layouts.quest([np.arange(pages)], [4096], [selected], PAGE, pages, HQ)
    _case(backend, "quest", *ba.layouts.per_head_views(randn(1, HQ, HEAD_DIM), *pool, HQ), quest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
