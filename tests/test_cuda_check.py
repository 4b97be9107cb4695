"""The pieces of `python -m benchmarks.cuda_check` that decide pass/fail, run eagerly on tiny CPU shapes.

The compiled runs and the timing are what the script itself does on a device;
here its workload driver and its at-scale cross-check are checked against the
dense reference in a few seconds.
"""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a folder of the repository, not part of the package
    sys.path.insert(0, str(ROOT))

import flexkv.manager  # noqa: E402
from benchmarks.cuda_check import Decode, bench_shape, run_workload, workload_specs  # noqa: E402
from single_thread import one_thread  # noqa: E402,F401


def _spec(name):
    return next(s for s in workload_specs(False) if s[0].startswith(name))


def test_workload_with_sources_cfg_rows_reverse_order_matches_reference():
    name, cfg, kw, _, _ = _spec("src+cfg")
    res = run_workload(name, cfg, kw, 5, "cpu", torch.float32, compiled=False)
    assert res["ok"] and res["max_err"] < 1e-4 and res["recompiles"] == 0, res


def test_a_wrong_output_fails_the_check(monkeypatch):
    name, cfg, kw, _, _ = _spec("per-query")
    attend = flexkv.manager.BoundedKVManager.attend
    monkeypatch.setattr(flexkv.manager.BoundedKVManager, "attend", lambda *a, **k: attend(*a, **k) + 1e-3)
    res = run_workload(name, cfg, kw, 3, "cpu", torch.float32, compiled=False)
    assert not res["ok"] and 5e-4 < res["max_err"] < 2e-3, res


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
