"""Attention over a layout, row by row: the plainest statement of what every tier computes.

:func:`attention_rows` gives each block row's queries its whole KV at once. The cost is in the microkernel:
:func:`~bsrattn.reference.microkernel.attend_range` gathers the row's KV once and runs its queries through
:func:`~bsrattn.reference.microkernel.attend` in tiles of bounded size, each tile reading only the keys it
can see (a causal tile stops at its last query), so the float64 state of a whole prefill row is never one
``[Hq, qo_len, kv_len]`` array. The plan executor (:mod:`.executor`) computes the same states a work item
at a time through the same body; the two differ only by the plan's cuts and merges, not in speed per key.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from bsrattn.reference.gather import kv_as_slots
from bsrattn.reference.microkernel import attend_range


class Progress:
    """A one-line progress report on stderr for a long call: silent for its first ``after`` seconds, and
    always when stderr is not a terminal (tests, doctests, pipes, logs)."""

    def __init__(self, label: str, total: int, after: float = 3.0):
        self.label, self.total, self.done, self.after = label, max(int(total), 1), 0, after
        self.start = self.last = time.perf_counter()
        self.live, self.shown = sys.stderr.isatty(), False

    def advance(self, work: int):
        self.done += int(work)
        now = time.perf_counter()
        if self.live and now - self.start >= self.after and (now - self.last >= 0.5 or self.done >= self.total):
            self.last, self.shown = now, True
            sys.stderr.write(f"\r{self.label}: {100 * self.done / self.total:3.0f}% ({now - self.start:.0f} s)")
            sys.stderr.flush()

    def close(self):
        if self.shown:
            sys.stderr.write("\n")


def attention_rows(spec, q, k, v, *, k_scale=None, v_scale=None, dtype=np.float64):
    """Each block row's queries over its whole KV; returns ``(o [nnz_qo, Hq, D], lse [nnz_qo, Hq])`` in ``dtype``."""
    k_slots = kv_as_slots(k, spec, k_scale, dtype)
    v_slots = kv_as_slots(v, spec, v_scale, dtype)
    layout = spec.layout
    out = np.zeros((layout.nnz_qo, spec.num_qo_heads, spec.head_dim), dtype)
    lse = np.full((layout.nnz_qo, spec.num_qo_heads), -np.inf, dtype)
    progress = Progress("reference attention", int(np.dot(layout.qo_lens, layout.kv_lens)))
    for r in range(layout.num_rows):
        qs, qe = int(layout.qo_indptr[r]), int(layout.qo_indptr[r + 1])
        out[qs:qe], lse[qs:qe] = attend_range(spec, q, k_slots, v_slots, r, qs, qe, 0, int(layout.kv_lens[r]), dtype)
        progress.advance((qe - qs) * int(layout.kv_lens[r]))
    progress.close()
    return out, lse
