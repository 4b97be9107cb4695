"""Steady-state step time of flexkv against what users use today (pytest-benchmark).

    python -m pytest benchmarks/ --benchmark-json=bench.json
    python -m benchmarks.report bench.json

For each workload in `configs/` (size `small`, or FLEXKV_BENCH_SIZE), every
implementation of `benchmarks.impls` times one full step (write + attention,
all layers; flexkv also plans) from the same steady state, after its first
step has been checked against flexkv's. Environment:

- FLEXKV_BENCH_THREADS: torch threads for every implementation (default: torch's);
- FLEXKV_BENCH_WORKLOADS: comma-separated subset (default: all four);
- FLEXKV_BENCH_SIZE: size of the configs (default: small);
- FLEXKV_BENCH_COMPILE: flexkv compile mode, layer or graph (default: layer);
- FLEXKV_BENCH_SECONDS: timing budget per implementation (default: 3).

`extra_info` of each benchmark: bytes per step, achieved GB/s, ratio to the
floor (measured right after, in the same process), host planning time, and
flexkv's compile time.
"""

import gc
import os
import statistics
import time
from pathlib import Path

import pytest
import torch

from benchmarks.impls import IMPLS, FlexKV, Floor, Steady, check
from flexkv.cli.workload import load_workload

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
WORKLOADS = [w for w in os.environ.get("FLEXKV_BENCH_WORKLOADS", "streaming-llm,tts-dit,conformer,per-query").split(",")
             if w]
SIZE = os.environ.get("FLEXKV_BENCH_SIZE", "small")
MODE = os.environ.get("FLEXKV_BENCH_COMPILE", "layer")
SECONDS = float(os.environ.get("FLEXKV_BENCH_SECONDS", "3"))
if os.environ.get("FLEXKV_BENCH_THREADS"):
    torch.set_num_threads(int(os.environ["FLEXKV_BENCH_THREADS"]))
ORDER = ["flexkv", "gather", "cat-slice", "unbounded", "floor"]

_state = {}


def _steady(name):
    """One Steady per workload (with flexkv's first-step output), built once; older ones are dropped."""
    if _state.get("name") != name:
        _state.clear()
        gc.collect()
        w = load_workload(str(CONFIGS / f"{name}.yaml"), SIZE)
        st = Steady(w)
        flex = FlexKV(st, MODE)
        first = st.inputs[0]
        expect = [o.clone() for o in flex.step(first)]
        _state.update(name=name, steady=st, flex=flex, expect=expect, first=first)
    return _state


def _floor_s(st, reps=7):
    f = Floor(st)
    f.step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@pytest.mark.parametrize("impl", ORDER)
@pytest.mark.parametrize("workload", WORKLOADS)
def test_step(benchmark, workload, impl):
    s = _steady(workload)
    st = s["steady"]
    if impl == "flexkv":
        obj = s["flex"]
        obj.plan_s.clear()
        err = 0.0
    else:
        # Every baseline starts from the state flexkv had before its first step.
        if impl == "floor":
            obj = Floor(st)
            err = None
        else:
            obj = IMPLS[impl](st)
            err = check(s["expect"], obj.step(s["first"]), impl)
    inputs = st.inputs
    counter = {"i": 1}

    def one():
        counter["i"] += 1
        with torch.no_grad():
            return obj.step(inputs[counter["i"] % len(inputs)])

    t0 = time.perf_counter()
    one()
    probe = time.perf_counter() - t0
    rounds = max(3, min(50, int(SECONDS / max(probe, 1e-4))))
    benchmark.pedantic(one, rounds=rounds, iterations=1, warmup_rounds=1)
    median = benchmark.stats.stats.median
    floor = _floor_s(st)
    nbytes = st.bytes_per_step()
    info = benchmark.extra_info
    info.update(
        workload=workload,
        size=SIZE,
        impl=impl,
        threads=torch.get_num_threads(),
        bytes_per_step=nbytes,
        gb_per_s=nbytes / median / 1e9,
        floor_ms=floor * 1e3,
        ratio_to_floor=median / floor,
        max_abs_diff_vs_flexkv=err,
        summary=st.w.summary(),
    )
    if impl == "flexkv":
        plan = statistics.median(obj.plan_s)
        info.update(plan_ms=plan * 1e3, plan_fraction=plan / median, compile_s=obj.compile_s,
                    compile_mode=MODE, slot_bytes=st.manager.slot_bytes,
                    memory_bytes=st.manager.memory_bytes, max_slots=st.cfg.max_slots)
    if impl == "unbounded":
        info.update(stream_len=obj.n)
    obj = None  # free it (`one` reads it, so not `del`)
    gc.collect()
