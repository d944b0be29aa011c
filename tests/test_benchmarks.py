"""The benchmark suite's CPU parts: workload 7's models, the correctness gate every GPU figure passes through,
the GPU scripts' plumbing in dry runs (tiny shapes on the CPU, no timing), and JSON -> plots / report on
synthetic records. The GPU workloads themselves run on the H200 (benchmarks/README.md).
"""

import json

import numpy as np
import pytest

import bsrattn as ba
from bsrattn.indexing import ceil_div
from bsrattn.testing import scattered_page_tables
from benchmarks import baselines, ceilings, correctness, harness, plots, records, report, run_all, timing
from benchmarks import w3_prefill, w7_cpu_models, w10_variants, w11_mla_decode

GPU_SCRIPTS = ("w1_quest_decode", "w2_paged_decode", "w3_prefill", "w4_split_kv", "w5_cascade", "w6_plan_host",
               "w8_run_host", "w9_transformers", "w10_variants", "w11_mla_decode")


def _dry_suite(tmp_path=None, impls=None):
    argv = ["--dry-run"] + (["--results", str(tmp_path)] if tmp_path else []) + (["--impls", impls] if impls else [])
    return harness.Suite("test_suite", "test", harness.parser("test").parse_args(argv))


# ---- workload 7 -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def w7_payload(tmp_path_factory):
    out = tmp_path_factory.mktemp("w7")
    w7_cpu_models.main(["--dry-run", "--results", str(out)])
    return json.loads((out / "w7_cpu_models.json").read_text())


def _w7(payload, table, **config):
    recs = [r for r in payload["records"] if r["config"]["table"] == table
            and all(r["config"][k] == v for k, v in config.items())]
    assert len(recs) == 1, (table, config, len(recs))
    return recs[0]


def test_w7_makespan_table_shape(w7_payload):
    assert _w7(w7_payload, "makespan", distribution="uniform kv=2048", batch=256)["median"] == 1.0
    assert _w7(w7_payload, "makespan", distribution="U(4096, 16384)", batch=32)["median"] > 3
    assert _w7(w7_payload, "makespan", distribution="lognormal", batch=256)["median"] > 1.5
    assert w7_payload["command"] == "python3 -m benchmarks.w7_cpu_models"
    assert w7_payload["environment"]["packages"]["numpy"]


def test_w7_read_amplification_matches_its_expectation(w7_payload):
    for budget in (64, 128):
        exact = _w7(w7_payload, "read_amplification", seq_len=4096, budget=budget, kernel_block_size=16)
        assert exact["ratio"] == 1.0 and exact["read_slots"] == exact["needed_slots"] == 32 * budget * 16
        coarse = _w7(w7_payload, "read_amplification", seq_len=4096, budget=budget, kernel_block_size=128)
        assert coarse["ratio"] > 1.5
        assert coarse["ratio"] == pytest.approx(coarse["expected_ratio"], rel=0.1)
    # Every page selected: nothing is wasted at any block size.
    assert _w7(w7_payload, "read_amplification", seq_len=4096, budget=256, kernel_block_size=128)["ratio"] == 1.0


def test_expected_ratio_edge_cases():
    assert w7_cpu_models.expected_ratio(256, 256, 16, 128) == pytest.approx(1.0)
    assert w7_cpu_models.expected_ratio(2048, 1, 16, 128) == pytest.approx(8.0)
    assert w7_cpu_models.expected_ratio(2048, 64, 16, 16) == 1.0


# ---- the correctness gate ---------------------------------------------------------------------------------
def _paged_problem(rng, kv_layout="NHD"):
    """Three requests, GQA 4/2, partial last pages, several queries per request (for causal rows)."""
    kv_lens, qo_lens, page, pool = np.array([37, 5, 20]), np.array([3, 1, 4]), 8, 12
    tables, _ = scattered_page_tables(rng, kv_lens, page, spare_pages=pool - int(ceil_div(kv_lens, page).sum()))
    layout = ba.layouts.paged(qo_lens, tables, kv_lens, page, pool)
    q = rng.standard_normal((qo_lens.sum(), 4, 8))
    shape = (pool, page, 2, 8) if kv_layout == "NHD" else (pool, 2, page, 8)
    return layout, q, rng.standard_normal(shape), rng.standard_normal(shape)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_rows_equal_rows_of_the_full_reference(kv_layout, causal):
    rng = np.random.default_rng(1)
    layout, q, k, v = _paged_problem(rng, kv_layout)
    full = ba.attention(q, k, v, layout, variant=ba.Variant(causal=causal), kv_layout=kv_layout,
                        backend="reference")
    rows = np.array([0, 2, 3, 5, 7])
    got = correctness.reference_rows(layout, q, k, v, rows, kv_layout=kv_layout, causal=causal)
    np.testing.assert_allclose(got, full[rows], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fields", [{"window_left": 3}, {"alibi_slopes": (0.5, 0.25, 0.125, 0.0625)},
                                    {"sinks": (0.5, -1.0, 2.0, 0.0)}, {"logits_soft_cap": 2.0},
                                    {"sigmoid_bias": -1.0}])
def test_reference_rows_apply_a_variant_at_the_rows_positions(fields):
    """Each checked row keeps its keys' positions and its query's, so a variant of positions gives the same row."""
    rng = np.random.default_rng(4)
    layout, q, k, v = _paged_problem(rng)
    variant = ba.Variant(causal=True, **fields)
    full = ba.attention(q, k, v, layout, variant=variant, backend="reference")
    rows = np.array([0, 2, 3, 5, 7])
    got = correctness.reference_rows(layout, q, k, v, rows, causal=True, variant=variant)
    np.testing.assert_allclose(got, full[rows], rtol=1e-12, atol=1e-12)


def test_reference_rows_dequantise_fp8_torch_tensors_like_the_reference_tier():
    torch = pytest.importorskip("torch")
    import ml_dtypes

    rng = np.random.default_rng(2)
    layout, q, k, v = _paged_problem(rng)
    k8 = torch.as_tensor(k).to(torch.float8_e4m3fn)
    v8 = torch.as_tensor(v).to(torch.float8_e4m3fn)
    q16 = torch.as_tensor(q).to(torch.float16)
    as_np = lambda x: x.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)  # noqa: E731
    full = ba.attention(q16.numpy(), as_np(k8), as_np(v8), layout, k_scale=0.75, v_scale=1.25, backend="reference")
    rows = np.arange(layout.nnz_qo)
    got = correctness.reference_rows(layout, q16, k8, v8, rows, k_scale=0.75, v_scale=1.25)
    # The reference returns q's dtype (float16); reference_rows keeps float64.
    np.testing.assert_allclose(got, full.astype(np.float64), rtol=2e-3, atol=2e-3)


def test_sample_rows_spread_within_the_budget():
    layout = ba.layouts.ragged(np.ones(100, dtype=np.int64), np.full(100, 64))
    rows = correctness.sample_rows(layout, 2, 8, max_rows=10)
    assert rows[0] == 0 and rows[-1] == 99 and len(rows) == 10
    tight = correctness.sample_rows(layout, 2, 8, max_rows=10, max_elements=3 * 64 * 2 * 8)
    assert tight.tolist() == [0, 11, 99]
    assert correctness.sample_rows(layout, 2, 8, max_elements=1).tolist() == [0]
    # A shared prefix is counted once: 64 requests over one 1000-slot prefix plus 10 slots each fit together.
    shared = ba.layouts.vector_sparse([np.r_[np.arange(1000), 1000 + 10 * b + np.arange(10)] for b in range(64)],
                                      np.ones(64, dtype=np.int64), num_slots=1640)
    assert len(correctness.sample_rows(shared, 1, 1, max_rows=64, max_elements=1640)) == 64
    assert len(correctness.sample_rows(shared, 1, 1, max_rows=64, max_elements=1100)) == 10


def _gate_problem():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    layout, q, k, v = _paged_problem(rng)
    q, k, v = (torch.as_tensor(x, dtype=torch.float32) for x in (q, k, v))
    rows = np.arange(layout.nnz_qo)
    expected = correctness.reference_rows(layout, q, k, v, rows)
    truth = torch.as_tensor(expected, dtype=torch.float32)
    out = torch.full_like(truth, float("nan"))
    return truth, out, dict(shape=tuple(truth.shape), rows=rows, expected=expected, dtype="float32")


def test_measure_accepts_right_and_rejects_wrong_implementations():
    torch = pytest.importorskip("torch")
    truth, out, checking = _gate_problem()
    suite = _dry_suite()

    def writes(fn):
        return lambda: lambda: fn(out)

    def skips_row_0(o):
        o[1:] = truth[1:]
        return o

    def unavailable():
        raise harness.Unavailable("not here")

    def broken():
        raise RuntimeError("kaboom")

    cases = {"right": writes(lambda o: o.copy_(truth)), "skips a row": writes(skips_row_0),
             "off by one row": writes(lambda o: o.copy_(torch.roll(truth, 1, 0))),
             "base-2 scale": writes(lambda o: o.copy_(truth * np.log2(np.e))),
             "unavailable": unavailable, "broken": broken}
    status = {name: suite.measure({"case": name}, name, build, out=out, **checking)["status"]
              for name, build in cases.items()}
    assert status == {"right": "ok", "skips a row": "incorrect", "off by one row": "incorrect",
                      "base-2 scale": "incorrect", "unavailable": "unavailable", "broken": "error"}
    wrong = [r for r in suite.records if r["status"] == "incorrect"]
    assert all("max |err|" in r["reason"] for r in wrong)


def test_the_poisoned_out_buffer_catches_a_stale_answer():
    """An implementation that returns ``out`` without writing passes only if ``out`` held the answer already."""
    truth, out, checking = _gate_problem()
    out.copy_(truth)
    rec = _dry_suite().measure({}, "lazy", lambda: lambda: out, out=out, **checking)
    assert rec["status"] == "incorrect"


def test_configurations_past_the_budget_are_recorded_as_skipped(tmp_path):
    args = harness.parser("t").parse_args(["--dry-run", "--results", str(tmp_path)])
    suite = harness.Suite("w4_split_kv", "W4 (test)", args)
    suite.deadline = suite.started - 1.0
    for batch, config in suite.configs([1, 2, 3], lambda b: {"batch": b}):
        suite.add(_rec(config, "bsrattn-torch", 5.0 * batch))
    skipped = [r for r in suite.records if r["status"] == "skipped"]
    assert [r["config"] for r in skipped] == [{"batch": 2}, {"batch": 3}] and {r["impl"] for r in skipped} == {"*"}
    suite.write()
    text = report.write_summary(tmp_path).read_text()
    assert "| batch=1 | 5.0 |" in text and "| batch=3 | skipped |" in text


def test_a_workload_run_in_parts_keeps_the_earlier_parts_of_the_same_commit(tmp_path, monkeypatch):
    def part(configs, budget=None):
        argv = ["--dry-run", "--results", str(tmp_path), "--configs", configs]
        suite = harness.Suite("w4_split_kv", "W4 (test)", harness.parser("t").parse_args(argv))
        if budget is not None:
            suite.deadline = suite.started - 1.0
        for batch, config in suite.configs([1, 2, 3], lambda b: {"batch": b}):
            suite.add(_rec(config, "bsrattn-torch", 5.0 * batch))
        suite.write()
        return json.loads((tmp_path / "w4_split_kv.json").read_text())["records"]

    def statuses(recs):
        return {(r["config"]["batch"], r["status"]) for r in recs}

    monkeypatch.setenv("BENCH_GIT_COMMIT", "a" * 40)
    assert statuses(part("batch=[12]", budget=0)) == {(1, "ok"), (2, "skipped")}
    assert statuses(part("batch=2,batch=3")) == {(1, "ok"), (2, "ok"), (3, "ok")}
    monkeypatch.setenv("BENCH_GIT_COMMIT", "b" * 40)  # another commit's records are not kept
    assert statuses(part("batch=3")) == {(3, "ok")}


def test_impls_filter_and_bound_and_stats():
    suite = _dry_suite(impls="sdpa*,flashinfer-*")
    assert suite.selected("sdpa-mask") and suite.selected("flashinfer-fa2") and not suite.selected("bsrattn-torch")
    assert suite.measure({}, "bsrattn-torch", None, shape=(), rows=[], expected=None, dtype="float16") is None
    ceil = {"copy_bytes_per_s": 4e12, "gemm_flops_per_s": 8e14}
    b = ceilings.bound(ceil, bytes_needed=8_000_000, flops=4e8)
    assert b["bound"] == "bytes" and b["bound_us"] == pytest.approx(2.0) and b["flops_us"] == pytest.approx(0.5)
    assert ceilings.bound(None, bytes_needed=1) == {}
    s = timing.stats([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s["median_us"] == 3.0 and s["min_us"] == 1.0 and s["samples"] == 5


# ---- the GPU scripts, dry-run on the CPU ------------------------------------------------------------------
# FlexAttention's CPU path goes through dynamo (~10 s on a CI core): its builders were checked by hand with
# ``--dry-run``, the CI test leaves them out.
NO_FLEX = "bsrattn-*,flashinfer-*,sdpa*,gather-*"


@pytest.mark.parametrize("name", GPU_SCRIPTS)
def test_gpu_script_dry_run(name, tmp_path):
    module = __import__(f"benchmarks.{name}", fromlist=["main"])
    module.main(["--dry-run", "--results", str(tmp_path), "--impls", NO_FLEX])
    payload = json.loads((tmp_path / f"{name}.json").read_text())
    assert payload["workload"] == name and payload["dry_run"]
    assert payload["command"].startswith("python3 -m benchmarks.")
    by_status = {}
    for rec in payload["records"]:
        by_status.setdefault(rec["status"], []).append(rec["impl"])
    assert set(by_status) <= {"ok", "unavailable"}, [r for r in payload["records"] if r["status"] != "ok"]
    if name != "w9_transformers":  # the one workload without FlashInfer
        assert by_status.get("unavailable") and all(
            r["impl"].startswith("flashinfer") for r in payload["records"] if r["status"] == "unavailable")
    assert any(impl.startswith("bsrattn-") for impl in by_status["ok"])
    if name in ("w6_plan_host", "w8_run_host", "w9_transformers"):
        assert all(r["host"]["samples"] > 0 for r in payload["records"] if r["status"] == "ok")
    if name not in ("w6_plan_host", "w9_transformers"):  # host timings of plans and model steps: no output rows
        checked = [r for r in payload["records"] if "check" in r]
        assert len(checked) == len(by_status["ok"])
        assert all(r["check"]["ok"] and r["check"]["rows_checked"] > 0 for r in checked)
    if name == "w10_variants":
        _check_w10(payload["records"])
    if name == "w11_mla_decode":
        _check_w11(payload["records"])


def _check_w10(records):
    """W10's dry run: every variant of both cases, bsrattn's rows all checked, and only the window changing the
    work (the keys a decode query sees, the pairs of a causal prefill)."""
    recs = {(r["config"]["case"], r["config"]["variant"]): r for r in records if r["impl"] == "bsrattn-reference"}
    assert set(recs) == {(c, v) for c in w10_variants.CASES for v in w10_variants.VARIANTS}
    assert all(r["status"] == "ok" for r in recs.values())
    assert recs["decode", "window"]["bytes"] < recs["decode", "none"]["bytes"] == recs["decode", "sinks"]["bytes"]
    assert recs["prefill", "window"]["flops"] < recs["prefill", "none"]["flops"] == recs["prefill", "alibi"]["flops"]
    assert w10_variants.band_flops([1024] * 16, -1, 32, 128) == w3_prefill.causal_flops([1024] * 16, 32, 128)


def _check_w11(records):
    """W11's dry run: bsrattn and the absorbed SDPA checked at every configuration, each with the work MLA needs (the
    latent slots once for all heads, FLOPs of every head over them)."""
    s = w11_mla_decode.DRY_SHAPE
    configs = [{"dtype": d, "page_size": p, "batch": b, "kv_len": n} for d, p, b, n in w11_mla_decode.DRY_CONFIGS]
    for config in configs:
        recs = {r["impl"]: r for r in records if r["config"] == config}
        assert recs["bsrattn-reference"]["status"] == recs["sdpa-absorbed"]["status"] == "ok"
        b, n, page = config["batch"], config["kv_len"], config["page_size"]
        width = s.head_dim_ckv + s.head_dim_kpe
        pages = b * -(-n // page)
        assert {r["flops"] for r in recs.values()} == {b * n * s.num_heads * (2 * width + 2 * s.head_dim_ckv)}
        assert {r["bytes"] for r in recs.values()} == {
            2 * (b * n * width + b * s.num_heads * (width + s.head_dim_ckv)) + 4 * (pages + 2 * b + 1)}


def test_tune_dry_run_measures_a_point_of_every_sweep(tmp_path):
    """The tile sweep's dry run: one point of each sweep (decode, prefill, MLA) runs the torch tier with the point's
    tiles in place of the tier's own, and answers as the reference does."""
    from benchmarks import tune

    tune.main(["--dry-run", "--results", str(tmp_path)])
    records = json.loads((tmp_path / "tune.json").read_text())["records"]
    assert [r["config"]["case"] for r in records] == [name for _, name, _ in tune.DRY_CASES]
    assert all(r["status"] == "ok" and r["check"]["ok"] for r in records), [r.get("reason") for r in records]
    assert records[-1]["config"]["max_rows"] == tune.MLA[0]["max_rows"]


def test_w10_alibi_slopes_are_the_geometric_ones():
    slopes = w10_variants.alibi_slopes(32)
    np.testing.assert_allclose(slopes, 2.0 ** (-0.25 * np.arange(1, 33)), rtol=1e-7)


def test_prebuild_builds_what_each_run_needs():
    quick = [name for name, _ in baselines.prebuild_steps(True, ["w10"])]
    full = [name for name, _ in baselines.prebuild_steps(False, ["w10"])]
    assert quick[:2] == ["decode fp16 (CUDA-core)", "ragged prefill bf16 fa2"]
    assert "ragged prefill bf16 fa2, RoPE" in quick and "attention sinks bf16 fa3" not in quick
    assert set(quick) < set(full) and "attention sinks bf16 fa3" in full
    assert [name for name, _ in baselines.prebuild_steps(True, ["w3"])] == [
        "ragged prefill bf16 fa2", "ragged prefill bf16 fa3",
        "paged prefill bf16 fa2, causal and not (W3's shared prefix)", "paged prefill bf16 fa3",
        "merge_state_in_place bf16"]
    assert [name for name, _ in baselines.prebuild_steps(True, ["w11"])] == ["MLA bf16 fa2", "MLA bf16 fa3"]
    assert [name for name, _ in baselines.prebuild_steps(False, ["w11"])][2:] == ["MLA fp16 fa2", "MLA fp16 fa3"]


# ---- plots and report from JSON alone ---------------------------------------------------------------------
def _rec(config, impl, t=None, status="ok", **extra):
    rec = {"config": config, "impl": impl, "status": status, **extra}
    if status != "ok":
        rec["reason"] = f"{status} on purpose"
    elif t is not None:
        rec.update(time_us=t, time_mode="graph", graph={"median_us": t}, eager={"median_us": 2 * t})
    return rec


def _timed(config, impl, t, bound_us, **extra):
    return _rec(config, impl, t, bound_us=bound_us, fraction=bound_us / t, **extra)


def synthetic_payloads():
    """One payload per GPU workload, shaped like the scripts' output, with known numbers."""
    ceilings = {"copy_bytes_per_s": 4.2e12, "gemm_flops_per_s": 7.9e14}

    def payload(name, records):
        return {"workload": name, "title": f"{name} (synthetic)", "command": f"python3 -m benchmarks.{name} --quick",
                "quick": True, "samples": 100, "ceilings": ceilings, "records": records,
                "environment": {"gpu": {"name": "NVIDIA H200", "sms": 132, "driver": "580"},
                                "packages": {"torch": "2.11"}, "git_commit": "abc", "time_utc": "now"}}

    w1 = [_timed({"seq_len": s, "budget": b}, impl, t * b / 64, 4.0 * b / 64, tb_per_s=3.0)
          for s in (4096, 32768) for b in (64, 512) for impl, t in (("bsrattn-torch", 7.0), ("flex-b128", 40.0))]
    w1.append(_rec({"seq_len": 4096, "budget": 64}, "flashinfer-cuda-core", status="unavailable"))
    w2 = [_timed({"dtype": "float16", "batch": b, "kv_len": 1024}, impl, t, 1.0 * b, tb_per_s=4.0 * t / b)
          for b in (1, 16) for impl, t in (("bsrattn-torch", 8.0), ("flashinfer-tensor-core", 13.0))]
    w2.append(_rec({"dtype": "float16", "batch": 1, "kv_len": 1024}, "sdpa-gather", status="incorrect"))
    w3 = [_timed({"lengths": "16 x 1024", "kv_layout": "ragged"}, impl, t, 174.0, tflop_per_s=1.4e5 / t)
          for impl, t in (("bsrattn-torch", 300.0), ("flashinfer-fa2", 428.0))]
    w4 = [_timed({"batch": b, "kv_len": "U(4096,16384)"}, impl, t, 10.0)
          for b in (1, 32) for impl, t in (("bsrattn-torch", 10.0), ("bsrattn-torch-no-split", 40.0),
                                           ("flashinfer-tensor-core", 27.0),
                                           ("flashinfer-tensor-core-no-split", 122.0))]
    w5 = [_timed({"prefix_len": 32768, "batch": 64, "suffix_len": 256}, impl, t, 191.0)
          for impl, t in (("bsrattn-torch-cascade", 200.0), ("bsrattn-torch-plain", 2800.0),
                          ("flashinfer-cascade-fa2", 249.0), ("flashinfer-plain-tensor-core", 3300.0))]
    w5.append({"config": {"prefix_len": 32768, "batch": 16, "suffix_len": 256}, "impl": "*", "status": "skipped",
               "reason": "time budget spent"})
    w6 = [dict(_rec({"batch": b, "kv_len": 4096}, impl, t * b ** 0.5), time_mode="host", host={"median_us": t})
          for b in (1, 256) for impl, t in (("bsrattn-torch", 20.0), ("flashinfer-tensor-core", 57.0))]
    w8 = [dict(_rec({"kind": "decode", "batch": 1, "kv_len": 1024}, impl, t), time_mode="host", host={"median_us": t},
               eager={"median_us": t + 9.0}) for impl, t in (("bsrattn-torch", 17.0), ("flashinfer-cuda-core", 21.0))]
    w9 = [dict(_rec({"batch": 8, "prompt": 4096}, impl, t), time_mode="host", host={"median_us": t})
          for impl, t in (("bsrattn-torch", 9000.0), ("sdpa", 10000.0), ("eager", 14000.0))]
    w10 = [_timed({"case": case, "variant": variant}, impl, t, 60.0)
           for case, variant, impl, t in (("decode", "none", "bsrattn-torch", 80.0),
                                          ("decode", "none", "flashinfer-cuda-core", 96.0),
                                          ("decode", "soft_cap", "bsrattn-torch", 88.0),
                                          ("decode", "soft_cap", "flashinfer-cuda-core", 120.0),
                                          ("decode", "sigmoid", "bsrattn-torch", 100.0),
                                          ("prefill", "none", "bsrattn-torch", 300.0),
                                          ("prefill", "none", "flashinfer-fa2", 428.0),
                                          ("prefill", "window", "bsrattn-torch", 200.0),
                                          ("prefill", "window", "flashinfer-fa2", 300.0))]
    w10.append(_rec({"case": "decode", "variant": "sinks"}, "flashinfer-paged-fa2", status="unavailable"))
    w11 = [_timed({"dtype": "bfloat16", "page_size": 64, "batch": b, "kv_len": 4096}, impl, t * b, 40.0 * b,
                  tb_per_s=3.0, tflop_per_s=500.0)
           for b in (1, 32) for impl, t in (("bsrattn-torch", 50.0), ("flashinfer-mla-fa2", 60.0),
                                            ("flashinfer-mla-fa3", 45.0))]
    w11.append(_rec({"dtype": "bfloat16", "page_size": 64, "batch": 1, "kv_len": 4096}, "sdpa-absorbed",
                    status="unavailable"))
    return {name: payload(name, recs)
            for name, recs in zip(GPU_SCRIPTS, (w1, w2, w3, w4, w5, w6, w8, w9, w10, w11))}


def test_plots_and_report_from_json_alone(tmp_path, w7_payload):
    for name, payload in synthetic_payloads().items():
        records.write_json(tmp_path / f"{name}.json", payload)
    records.write_json(tmp_path / "w7_cpu_models.json", w7_payload)
    drawn = plots.draw_all(tmp_path)
    assert sorted(p.stem for p in drawn) == sorted(report.ORDER)
    assert all(p.stat().st_size > 5000 for p in drawn)
    text = report.write_summary(tmp_path).read_text()
    assert text.count("\n## ") == 11 and "Not run yet" not in text
    for name in report.ORDER:
        assert f"python3 -m benchmarks.{name}" in text and f"![{name}]({name}.png)" in text
    assert "| seq_len=4096 budget=64 | 4.0 | 7.0 (0.57) | 40.0 (0.10) | n/a | 3.00 |" in text
    assert "| seq_len=32768 budget=512 | 32.0 | 56.0 (0.57) | 320.0 (0.10) | — | 3.00 |" in text
    assert "| dtype=float16 batch=16 kv_len=1024 | 16.0 | 8.0 (2.00) | 13.0 (1.23) | — | 2.00 | 1.62x |" in text
    assert "300 µs, 467 TF/s" in text
    assert "| batch=1 kv_len=U(4096,16384) | 10.0 | 40.0 | 4.00x | 27.0 | 122.0 | 4.52x |" in text
    assert "14.00x | 13.25x | 1.25x |" in text  # bsrattn and FlashInfer plain/cascade, FlashInfer / bsrattn
    assert "skipped" in text and "WRONG" in text and "incorrect on purpose" in text
    assert "4.20 TB/s" in text and "790 TFLOP/s" in text
    assert "| kind=decode batch=1 kv_len=1024 | 17.0 (26.0) | 21.0 (30.0) |" in text
    assert "| batch=8 prompt=4096 | 9.00 | 10.00 | 14.00 | 1.11x |" in text
    assert "| none | 80.0 | 96.0 | — | 1.20x |" in text  # bsrattn, CUDA-core, paged fa2; FlashInfer / bsrattn
    assert "| soft_cap | 88.0 (+10%) | 120.0 (+25%) | — | 1.36x |" in text
    assert "| sinks | — | — | n/a | — |" in text and "| sigmoid | 100.0 (+25%) | — | — | — |" in text
    assert "| window | 200.0 (-33%) | 300.0 (-30%) | 1.50x |" in text
    # W11: bound, bsrattn, fa2, fa3, SDPA; bsrattn's TB/s and TFLOP/s; FlashInfer's best (fa3) / bsrattn
    assert ("| dtype=bfloat16 page_size=64 batch=1 kv_len=4096 | 40.0 | 50.0 (0.80) | 60.0 (0.67) | 45.0 (0.89) | n/a "
            "| 3.00 | 500 | 0.90x |") in text


def test_plots_survive_records_without_times(tmp_path):
    """A dry run or a run where everything failed has no times: the figures still draw, empty."""
    for name, payload in synthetic_payloads().items():
        if name not in ("w1_quest_decode", "w4_split_kv", "w6_plan_host", "w10_variants", "w11_mla_decode"):
            continue
        empty = dict(payload, records=[dict(r, status="unavailable", reason="dry run") for r in payload["records"]])
        assert plots.draw(empty, tmp_path / f"{name}.png").stat().st_size > 0


def test_run_all_deadlines_and_selection(capsys):
    quick = run_all._deadlines(["w1", "w7"], True, None, 1000.0)
    assert quick == {"w1": 1000.0 + run_all.QUICK_BUDGET_S["w1"],
                     "w7": 1000.0 + run_all.QUICK_BUDGET_S["w1"] + run_all.QUICK_BUDGET_S["w7"]}
    scaled = run_all._deadlines(["w1", "w2"], True, 95.0, 0.0)
    assert scaled["w2"] == pytest.approx(95.0) and 0 < scaled["w1"] < scaled["w2"]
    assert run_all._deadlines(["w3"], False, None, 0.0) == {"w3": None}
    with pytest.raises(SystemExit):
        run_all.main(["--only", "w12"])
    assert "unknown workloads ['w12']" in capsys.readouterr().err
