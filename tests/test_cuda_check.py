"""The pieces of `python -m benchmarks.cuda_check` that decide pass/fail, run eagerly on tiny CPU shapes.

The compiled runs and the timing are what the script itself does on a device;
here its workload driver and its at-scale cross-check are checked against the
dense reference in a few seconds.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a folder of the repository, not part of the package
    sys.path.insert(0, str(ROOT))

from random_workload import relative_error  # noqa: E402

import flexkv.cache.manager  # noqa: E402
from benchmarks.cuda_check import Decode, bench_shape, run_workload, save_report, variant_runs, workload_specs  # noqa: E402
from single_thread import one_thread  # noqa: E402,F401


def _spec(name):
    return next(s for s in workload_specs(False) if s[0].startswith(name))


def test_workload_with_sources_cfg_rows_reverse_order_matches_reference():
    name, cfg, kw, _, _ = _spec("src+cfg")
    res = run_workload(name, cfg, kw, 5, "cpu", torch.float32, compiled=False)
    assert res["ok"] and res["rel_err"] < 1e-5 and res["recompiles"] == 0, res


def test_a_wrong_output_fails_the_check(monkeypatch):
    name, cfg, kw, _, _ = _spec("per-query")
    attend = flexkv.cache.manager.BoundedKVManager.attend
    monkeypatch.setattr(flexkv.cache.manager.BoundedKVManager, "attend", lambda *a, **k: attend(*a, **k) + 1e-3)
    res = run_workload(name, cfg, kw, 3, "cpu", torch.float32, compiled=False)
    assert not res["ok"] and 5e-4 < res["max_abs_err"] < 2e-3 and res["rel_err"] > 1e-4, res


def test_decode_setup_lays_out_what_attend_reads():
    """The contiguous keys and values SDPA times (and is compared with) hold what flexkv attends."""
    d = Decode(torch.device("cpu"), bench_shape(False))
    step = d.step()
    plan = d.m.plan(step)
    with torch.no_grad():
        out = d.m.attend(0, d.q, d.k[0], d.v[0], plan)
    K, V = d.contiguous_kv(plan, 0)
    assert K.shape == (d.s["requests"], d.s["kv_heads"], d.s["sink"] + d.s["window"], d.s["head_dim"])
    K, V = torch.cat([K, d.k[0]], dim=2), torch.cat([V, d.v[0]], dim=2)
    ref = torch.nn.functional.scaled_dot_product_attention(d.q, K, V, enable_gqa=True)
    assert (out - ref).abs().max().item() < 1e-4
    # One row, one KV head, one layer: sink + window entries of head_dim floats, keys and values.
    assert d.read_bytes(1) == 2 * d.s["kv_heads"] * (d.s["sink"] + d.s["window"]) * d.s["head_dim"] * 4


def test_the_error_is_relative_to_the_reference_norm():
    ref = torch.full((4, 8), 0.01)
    assert abs(relative_error(ref + 0.001, ref) - 0.1) < 1e-6  # a 1e-3 offset is 10% of outputs of 1e-2
    assert relative_error(ref, ref) == 0.0


def test_full_block_workload_plans_full_blocks_and_matches_reference():
    name, cfg, kw, _, _ = _spec("full-blocks-forced-decode")
    res = run_workload(name, cfg, kw, 4, "cpu", torch.float32, compiled=False)
    assert res["ok"] and res["full_blocks_planned"] > 0, res


def test_a_full_block_check_whose_plans_list_none_fails():
    """A workload asked to check full blocks whose rows never hold a whole block checks nothing."""
    name, cfg, kw, _, _ = _spec("sinks-decode")
    res = run_workload(name, cfg, dict(kw, full_blocks=True), 2, "cpu", torch.float32, compiled=False)
    assert res["full_blocks_planned"] == 0 and not res["ok"] and "no plan listed a full block" in res["error"], res


@pytest.mark.parametrize("name", ["sinks-decode", "sinks-T33"])
def test_learned_sinks_workloads_match_reference(name):
    name, cfg, kw, _, _ = _spec(name)
    res = run_workload(name, cfg, kw, 3, "cpu", torch.float32, compiled=False)
    assert res["ok"] and res["rel_err"] < 1e-5, res


@pytest.mark.parametrize("name, path", [("recall-chunk", "auto"), ("recall-chunk", "flex"),
                                        ("recall-query-window", "flex"), ("recall-decode", "auto"),
                                        ("recall-decode", "flex")])
def test_recall_workloads_fill_their_memories_and_match_reference(name, path):
    """The CPU twin of the GPU check's `Recall` rows: streams long enough that memories fill and wrap, on the
    rows path and through eager FlexAttention (the memory copied next to the window, or joined with a
    score_mod), as the GPU runs them."""
    name, cfg, kw, steps, _ = _spec(name)
    res = run_workload(name, cfg, dict(kw, path=path), steps, "cpu", torch.float32, compiled=False)
    assert res["ok"] and res["rel_err"] < 1e-5, res
    r = cfg.retention
    assert steps * kw["tokens"] > r.sink + r.window + r.memory  # the check is long enough to wrap a memory


def test_no_variant_repeats_the_shipped_kernel_options():
    """On the CPU `attend` passes no kernel options, so "torch's defaults" would be the shipped run."""
    d = Decode(torch.device("cpu"), bench_shape(False))
    runs, repeats = variant_runs(d)
    assert repeats == ["kernel_options=None (torch defaults)"]
    names = [r[0] for r in runs]
    assert names[0] == "no full-block tensors" and "main kernel (FORCE_USE_FLEX_ATTENTION)" in names


def test_report_is_written_whole(tmp_path):
    path = tmp_path / "report.json"
    save_report(str(path), {"correctness": [{"name": "a", "ok": True}]})
    save_report(str(path), {"correctness": [{"name": "a", "ok": True}, {"name": "b", "ok": False}]})
    assert [r["name"] for r in json.loads(path.read_text())["correctness"]] == ["a", "b"]
    assert not (tmp_path / "report.json.tmp").exists()


def test_checks_run_in_two_passes_bf16_first():
    from benchmarks.cuda_check import correctness_rows

    first = [(n, d) for n, _, _, _, d in correctness_rows(True, True)]
    second = [(n, d) for n, _, _, _, d in correctness_rows(True, False)]
    every = [(n, d) for n, _, _, _, ds in workload_specs(True) for d in ds]
    assert sorted(first + second, key=str) == sorted(every, key=str)
    only_fp32 = {n for n, _, _, _, ds in workload_specs(True) if ds == (torch.float32,)}
    assert "per-query-window+score_mod+gqa4" in only_fp32
    assert all(d == torch.bfloat16 for n, d in first if n not in only_fp32)
    assert all(d == torch.float32 for _, d in second)


def test_nothing_starts_past_the_deadline():
    from benchmarks.cuda_check import correctness

    report, saves = {}, []
    correctness(torch.device("cpu"), report, lambda: saves.append(1), first=True, deadline=0.0)
    assert report["correctness"] == [] and saves == []
    assert report["skipped"] and all("past the deadline" in s for s in report["skipped"])


def test_a_fault_that_loses_the_cuda_context_skips_the_rest_instead_of_failing_it(monkeypatch):
    """After an illegal memory access every later kernel fails the same way: those rows are reported as
    skipped with the reason, and the run fails naming the workload that faulted."""
    from benchmarks import cuda_check

    ran = []

    def fake(name, cfg, kw, steps, device, dtype, **_):
        ran.append(name)
        error = "AcceleratorError: CUDA error: an illegal memory access was encountered" if len(ran) == 2 else None
        return dict(name=name, dtype=str(dtype), ok=error is None, error=error)

    monkeypatch.setattr(cuda_check, "run_workload", fake)
    report: dict = {}
    cuda_check.correctness(torch.device("cpu"), report, lambda: None, first=True)
    first, second = ran
    assert [r["name"] for r in report["correctness"]] == [first, second]
    assert report["context_lost"].startswith(second)
    assert len(report["skipped"]) == len(cuda_check.correctness_rows(False, True)) - 2
    assert all("context was lost" in s for s in report["skipped"])
    assert cuda_check._failures(report)[-1].startswith(f"the CUDA context was lost at {second}")


def test_the_paged_section_passes_on_the_cpu():
    """`benchmarks.cuda_check`'s paged section (the vLLM plugin's GPU path, torch alone), compiled at its CPU
    shapes (float32, and steps of 1, 8 and 64 tokens, to keep the suite's compile time down): every row against
    the dense reference, and the recompile count over step sizes."""
    from benchmarks import cuda_paged

    report: dict = {}
    with torch.no_grad():
        cuda_paged.correctness(cuda_paged.shape_for(False), torch.device("cpu"), report, dtypes=(torch.float32,))
        cuda_paged.recompiles(cuda_paged.shape_for(False), torch.device("cpu"), report, steps=(1, 8, 64))
    assert len(report["correctness"]) == 4 and all(r["ok"] for r in report["correctness"]), report
    assert report["recompiles"]["ok"], report["recompiles"]
    assert cuda_paged.failures(dict(paged=report)) == []
    report["correctness"][0]["ok"] = False
    assert cuda_paged.failures(dict(paged=report)) == ["paged: decode x3 past eviction float32 cache"]
