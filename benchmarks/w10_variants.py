"""Workload 10: the cost of the attention variants, each call against the same call with no variant.

Two cases, 32 query / 8 KV heads, head_dim 128:

- ``decode``: paged decode, batch 16 x kv_len 4096, page 16, pages scattered, fp16 (a W2 configuration);
- ``prefill``: ragged causal prefill, 16 x 1024 (``qo_len == kv_len``), bf16 (a W3 configuration).

Each runs with no variant (``variant=none``, the row every other one is compared with) and with one variant at
a time (``config["variant"]``):

- ``soft_cap``: ``logits_soft_cap=30``. The queries are scaled by 30 in this configuration (scores of standard
  deviation ~30), so the cap bends most scores and the check tells a kernel that ignored it;
- ``window``: ``window_left = kv_len / 4 - 1`` (1023 at decode, 255 at prefill);
- ``alibi``: the geometric slopes ``2^(-8 h / 32)``, ``h = 1..32`` (:func:`alibi_slopes`);
- ``sinks``: one sink logit per query head, ``log(kv_len) + N(0, 1)``, so a sink takes a share of its softmax
  that the check sees (a logit of ``N(0, 1)`` would weigh ~1 / kv_len);
- ``kv_scale``: ``k_scale=0.5, v_scale=2.0`` given to ``run`` on the 16-bit KV;
- ``rope``: fused RoPE, ``Variant(rope_theta=1e4, rope_scale=1.0)`` (Llama's rotate-half form, ``q`` rotated at
  its position ``kv_len - qo_len + i``, a key at its slot of the request);
- ``sigmoid``: FlashSigmoid, ``sigmoid_bias = -log(kv_len)``.

The bound is W2's (bytes, decode; a window's keys only) or W3's (causal FLOPs counted once, prefill; a window
counts the pairs inside it). The report gives each variant's time and its change over the ``none`` row of the
same implementation, and FlashInfer's best over bsrattn's per variant.

Implementations, each checked against the float64 reference (the same variant), then timed in graph and
eager mode:

- ``bsrattn-torch``: planned once with the variant (``BatchAttention.plan(variant=...)``; the scales to ``run``).
- decode, ``flashinfer-cuda-core``, ``flashinfer-tensor-core``: ``BatchDecodeWithPagedKVCacheWrapper`` with
  ``plan(logits_soft_cap=)``, ``plan(window_left=)``, ``plan(pos_encoding_mode="ALIBI")``,
  ``plan(pos_encoding_mode="ROPE_LLAMA", rope_theta=, rope_scale=)`` and ``run(k_scale=, v_scale=)``;
- prefill, ``flashinfer-fa2``, ``flashinfer-fa3``: ``BatchPrefillWithRaggedKVCacheWrapper``, the same ``plan``
  keywords (fa3: soft cap and window only);
- ``flashinfer-paged-fa2`` (decode; prefill also ``-fa3``): ``BatchPrefillWithPagedKVCacheWrapper`` (prefill:
  the same keys as pages of one token), for the variants the wrappers above lack: ``sinks`` through its
  subclass ``BatchAttentionWithAttentionSinkWrapper`` (``run(q, kv, sinks, sm_scale)``) and, at prefill,
  ``run(k_scale=, v_scale=)``; its ``none`` row is the plain wrapper.

FlashInfer rows left out, because 0.6.6 has no counterpart with bsrattn's semantics:

- ``sigmoid`` everywhere: no wrapper computes FlashSigmoid (its JIT customisation could, but that would be a
  kernel written here, not FlashInfer's);
- ``sinks`` on the decode and ragged wrappers: ``BatchDecodeWithPagedKVCacheWrapper.run(sinks=)`` reaches only
  the trtllm-gen backend (Blackwell), the CUDA-core and fa2 kernels ignore it; the ragged wrapper takes none;
- ``kv_scale`` on the ragged wrapper: its ``run`` takes ``k_scale`` / ``v_scale`` but only its cutlass and cuDNN
  backends use them (fa2 / fa3 ignore them);
- ``alibi`` and ``rope`` on fa3: FlashInfer's fa3 kernels have no positional encoding (its
  ``is_fa3_backend_supported`` is False for any ``pos_encoding_mode`` but ``NONE``).

FlashInfer's ALiBi uses slopes of its own (``flashinfer.utils.get_alibi_slopes``); they are the ones given to
bsrattn here, and the build checks that they agree (else ``unavailable``). Its bias is ``slope * (kv_idx -
qo_idx)`` with the query's index in its request (0 at decode) where bsrattn uses positions: a constant per row,
which the softmax cancels, so the outputs are the same. The ``--quick`` run keeps every configuration and
FlashInfer's ``flashinfer-cuda-core`` (decode) and ``flashinfer-fa2`` (prefill).

Run: ``python3 -m benchmarks.w10_variants [--quick]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import numpy as np

import bsrattn as ba
from benchmarks import baselines, correctness, harness, w2_paged_decode, w3_prefill

WORKLOAD = "w10_variants"
TITLE = ("W10: the cost of the attention variants (32/8 heads, d128; decode 16 x 4096 fp16 page 16, causal "
         "prefill 16 x 1024 bf16)")
VARIANTS = ("none", "soft_cap", "window", "alibi", "sinks", "kv_scale", "rope", "sigmoid")
CASES = {"decode": (16, 4096), "prefill": (16, 1024)}  # batch, kv_len
DRY_CASES = {"decode": (2, 32), "prefill": (2, 24)}
SOFT_CAP = 30.0
K_SCALE, V_SCALE = 0.5, 2.0
ROPE = {"rope_theta": 1e4, "rope_scale": 1.0}
FLASHINFER = {
    "decode": {"flashinfer-cuda-core": ("none", "soft_cap", "window", "alibi", "kv_scale", "rope"),
               "flashinfer-tensor-core": ("none", "soft_cap", "window", "alibi", "kv_scale", "rope"),
               "flashinfer-paged-fa2": ("none", "sinks")},
    "prefill": {"flashinfer-fa2": ("none", "soft_cap", "window", "alibi", "rope"),
                "flashinfer-fa3": ("none", "soft_cap", "window"),
                "flashinfer-paged-fa2": ("none", "kv_scale", "sinks"),
                "flashinfer-paged-fa3": ("none", "kv_scale", "sinks")},
}
"""Per case, each FlashInfer implementation and the variants it has a counterpart of (the module docstring says
which are missing and why)."""
QUICK_FLASHINFER = {"decode": ("flashinfer-cuda-core",), "prefill": ("flashinfer-fa2",)}


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The geometric ALiBi slopes (Press et al.), as FlashInfer's ``get_alibi_slopes`` computes them, in float32.

    ``2^(-8 h / n)`` for ``h = 1..n``, ``n`` the largest power of 2 up to ``num_heads``; the heads past ``n``
    take ``2^(-4 h / n)`` for odd ``h``.

    >>> alibi_slopes(4).tolist()
    [0.25, 0.0625, 0.015625, 0.00390625]
    >>> alibi_slopes(6).tolist()[4:]
    [0.5, 0.125]
    """
    n = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = 2.0 ** (-8.0 / n * np.arange(1, n + 1))
    if n < num_heads:
        slopes = np.concatenate([slopes, 2.0 ** (-4.0 / n * np.arange(1, 2 * (num_heads - n), 2))])
    return slopes.astype(np.float32).astype(np.float64)


def band_flops(lens, window: int, num_qo_heads: int, head_dim: int) -> int:
    """``4 * D * Hq`` times the pairs causal rows of ``qo_len == kv_len`` see: query ``i`` sees ``min(i, window)
    + 1`` keys (``window`` -1: all ``i + 1``, W3's :func:`~benchmarks.w3_prefill.causal_flops`).

    >>> band_flops([4], -1, 1, 1), band_flops([4], 1, 1, 1)
    (40, 28)
    """
    pairs = 0
    for n in np.asarray(lens, dtype=np.int64).tolist():
        seen = np.arange(n) if window < 0 else np.minimum(np.arange(n), window)
        pairs += int((seen + 1).sum())
    return 4 * head_dim * num_qo_heads * pairs


@dataclass
class Case:
    """One of the two problems, built once for all its variants."""

    kind: str  # "decode" or "prefill"
    base: object  # the W2 or W3 case: layout, q, k, v, out, checked rows and their reference with no variant
    kv_len: int

    @property
    def shape(self):
        return self.base.shape

    @property
    def causal(self) -> bool:
        return self.kind == "prefill"

    @property
    def dtype(self) -> str:
        return self.base.q_dtype if self.kind == "decode" else self.shape.dtype


def make_case(suite, kind: str) -> Case:
    """W2's decode or W3's ragged prefill case at this run's shapes."""
    batch, kv_len = (DRY_CASES if suite.dry_run else CASES)[kind]
    lens = np.full(batch, kv_len)
    if kind == "decode":
        shape = w2_paged_decode.DRY_SHAPE if suite.dry_run else w2_paged_decode.GPU_SHAPE
        return Case(kind, w2_paged_decode.make_case(suite, shape, "float16", lens), kv_len)
    shape = w3_prefill.DRY_SHAPE if suite.dry_run else w3_prefill.GPU_SHAPE
    return Case(kind, w3_prefill.make_case(suite, shape, lens, "ragged"), kv_len)


@dataclass(frozen=True)
class Spec:
    """One variant on one case: what bsrattn's ``plan`` and ``run`` are given, and FlashInfer's ``plan``."""

    name: str
    fields: dict = field(default_factory=dict)  # ba.Variant's fields (besides the prefill's causal)
    scales: dict = field(default_factory=dict)  # run's k_scale / v_scale
    q_gain: float = 1.0  # the queries are multiplied by it
    flashinfer: dict = field(default_factory=dict)  # FlashInfer plan keywords of the same variant

    @property
    def window(self) -> int:
        return self.fields.get("window_left", -1)


def make_spec(name: str, case: Case, rng) -> Spec:
    """The variant ``name`` on ``case`` (see the module docstring)."""
    heads, kv_len = case.shape.num_qo_heads, case.kv_len
    window = kv_len // 4 - 1
    if name == "soft_cap":
        return Spec(name, {"logits_soft_cap": SOFT_CAP}, q_gain=SOFT_CAP, flashinfer={"logits_soft_cap": SOFT_CAP})
    if name == "window":
        return Spec(name, {"window_left": window}, flashinfer={"window_left": window})
    if name == "alibi":
        return Spec(name, {"alibi_slopes": tuple(alibi_slopes(heads))}, flashinfer={"pos_encoding_mode": "ALIBI"})
    if name == "sinks":
        sinks = (math.log(kv_len) + rng.standard_normal(heads)).astype(np.float32).astype(np.float64)
        return Spec(name, {"sinks": tuple(sinks)})
    if name == "kv_scale":
        return Spec(name, scales={"k_scale": K_SCALE, "v_scale": V_SCALE})
    if name == "rope":
        return Spec(name, dict(ROPE), flashinfer={"pos_encoding_mode": "ROPE_LLAMA", **ROPE})
    if name == "sigmoid":
        return Spec(name, {"sigmoid_bias": -math.log(kv_len)})
    return Spec(name)


def check_args(case: Case, spec: Spec, expected) -> dict:
    """The case's check and cost arguments for :meth:`~benchmarks.harness.Suite.measure`, for ``spec``: its
    reference rows, and the bytes (decode) or FLOPs (prefill) a window leaves."""
    args = dict(case.base.check_args(), expected=expected)
    s = case.shape
    if case.kind == "decode" and spec.window >= 0:
        lens = case.base.kv_lens
        outside = int((lens - np.minimum(lens, spec.window + 1)).sum())
        args["bytes_needed"] -= outside * s.num_kv_heads * s.head_dim * 2 * case.base.k.element_size()
    if case.kind == "prefill":
        args["flops"] = band_flops(case.base.lens, spec.window, s.num_qo_heads, s.head_dim)
    return args


def check_alibi(slopes):
    """Raise :class:`~benchmarks.harness.Unavailable` unless FlashInfer's ALiBi slopes are ``slopes``."""
    baselines.flashinfer()
    from flashinfer.utils import get_alibi_slopes

    theirs = get_alibi_slopes(len(slopes)).double().numpy()
    if not np.allclose(theirs, slopes, rtol=1e-6, atol=0):
        raise harness.Unavailable("FlashInfer's ALIBI mode uses slopes of its own, not the ones given to bsrattn")


def build_flashinfer(case: Case, spec: Spec, impl: str, q):
    """``impl``'s counterpart of ``spec`` on ``case`` (see :data:`FLASHINFER`), planned; ``q`` the queries."""
    import torch

    base, s = case.base, case.shape
    heads = dict(num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim)
    dtype = getattr(torch, case.dtype)
    if spec.name == "alibi":
        check_alibi(spec.fields["alibi_slopes"])
    if impl in ("flashinfer-cuda-core", "flashinfer-tensor-core"):
        wrapper = baselines.decode_wrapper(*base.page_table_tensors(), page_size=s.page_size, q_dtype=dtype,
                                           kv_dtype=dtype, tensor_cores=impl == "flashinfer-tensor-core", **heads,
                                           **spec.flashinfer)
        return lambda: wrapper.run(q, (base.k, base.v), out=base.out, **spec.scales)
    backend = impl.rsplit("-", 1)[1]
    lay = base.layout
    if impl in ("flashinfer-fa2", "flashinfer-fa3"):
        wrapper = baselines.ragged_prefill_wrapper(*base.tensors(lay.qo_indptr, lay.kv_indptr), dtype=dtype,
                                                   causal=True, backend=backend, **heads, **spec.flashinfer)
        return lambda: wrapper.run(q, base.k, base.v, out=base.out)
    # flashinfer-paged-*: decode's page table with one query per request, or the prefill's keys as pages of one
    if case.kind == "decode":
        qo_indptr = torch.arange(base.batch + 1, dtype=torch.int32, device=q.device)
        tables, k, v, page = (qo_indptr, *base.page_table_tensors()), base.k, base.v, s.page_size
    else:
        tables = base.tensors(lay.qo_indptr, lay.kv_indptr, lay.kv_indices, lay.kv_last_len)
        k, v, page = base.k.unsqueeze(1), base.v.unsqueeze(1), 1
    paged = dict(page_size=page, dtype=dtype, causal=case.causal, backend=backend, **heads)
    if spec.name == "sinks":
        wrapper = baselines.sink_prefill_wrapper(*tables, **paged)
        sinks = torch.tensor(spec.fields["sinks"], dtype=torch.float32, device=q.device)
        sm_scale = 1.0 / math.sqrt(s.head_dim)
        return lambda: wrapper.run(q, (k, v), sinks, sm_scale, out=base.out)
    wrapper = baselines.paged_prefill_wrapper(*tables, **paged)
    return lambda: wrapper.run(q, (k, v), out=base.out, **spec.scales)


def measure_variant(suite, config: dict, case: Case, spec: Spec) -> None:
    """bsrattn and FlashInfer's counterparts of ``spec`` on ``case``, each against the reference of ``spec``."""
    tier = "reference" if suite.dry_run else "torch"
    flashinfer = [impl for impl, names in FLASHINFER[case.kind].items() if spec.name in names
                  and (not suite.quick or impl in QUICK_FLASHINFER[case.kind])]
    base = case.base
    variant = ba.Variant(causal=case.causal, **spec.fields)
    q = base.q * spec.q_gain if spec.q_gain != 1.0 else base.q
    expected = base.expected if spec.name == "none" else correctness.reference_rows(
        base.layout, q, base.k, base.v, base.rows, causal=case.causal, variant=variant, **spec.scales)
    checking = check_args(case, spec, expected)
    s = case.shape
    plan = dict(num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, variant=variant,
                q_dtype=case.dtype, kv_dtype=case.dtype)
    harness.measure_bsrattn(suite, config, f"bsrattn-{tier}", tier, base.layout, q, base.k, base.v, plan=plan,
                            out=base.out, run=spec.scales, **checking)
    for impl in flashinfer:
        suite.measure(config, impl, partial(build_flashinfer, case, spec, impl, q), out=base.out, needs_cuda=True,
                      **checking)


def run(suite) -> None:
    items = [(kind, name) for kind in CASES for name in VARIANTS]
    case = None
    for (kind, name), config in suite.configs(items, lambda c: {"case": c[0], "variant": c[1]}):
        if case is None or case.kind != kind:
            case = make_case(suite, kind)
        measure_variant(suite, config, case, make_spec(name, case, suite.rng))


def main(argv=None):
    harness.run_script(WORKLOAD, TITLE, run, __doc__, argv)


if __name__ == "__main__":
    main()
