"""Chunked steps and decode, flexkv with default settings against the dense way, in one process.

Shapes (all fp32, attention only, steady state: every stream far past its window):

- `encoder`: a streaming speech encoder; 32 rows, chunks of T 14 (all written), window 70,
  no sink, 4 layers, 8 heads x 64;
- `dit`: a flow-matching DiT; 8 requests x 2 CFG rows, chunks of T 50 joining the stream in
  reverse order, a shared 302-entry source of which 100 are sinks, window 302, 4 layers,
  8 heads x 64;
- `decode`: StreamingLLM decode; 32 requests, 4 sinks + window 1020, 32 query / 8 KV heads x 64,
  4 layers.

Each shape runs:

- `flexkv`: host admit + plan, then one compiled `attend` per layer, then commit, with every
  setting left to flexkv (block size, attention path);
- `flexkv/flex`: the same with `attention_path="flex"` (one FlexAttention call per layer on
  every device), to show what the chosen path gains;
- `dense`: each row's retained entries kept contiguous: `torch.cat` of the step, one batched
  `scaled_dot_product_attention`, slice back to sink + window.

The first step of every implementation is checked against flexkv's. Times are medians of
`torch.utils.benchmark.Timer.blocked_autorange`.

    python -m benchmarks.chunked              # the table
    python -m benchmarks.chunked --markdown   # the same, for docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.benchmark import Timer

from benchmarks.impls import CatSlice, FlexKV, Steady, check
from flexkv.workload import Workload

SHAPES = {
    "encoder": Workload(name="encoder", layers=4, kv_heads=8, head_dim=64, window=70, span=14, tokens=14,
                        requests=32, stream_len=(140, 1400)),
    "dit": Workload(name="dit", layers=4, kv_heads=8, head_dim=64, window=302, rows=2, source_len=302,
                    sources=2, sink=100, reverse_step_order=True, span=50, tokens=50, requests=8,
                    stream_len=(300, 1500)),
    "decode": Workload(name="decode", layers=4, kv_heads=8, q_heads=32, head_dim=64, sink=4, window=1020,
                       span=1, requests=32, stream_len=(600, 3000)),
}


def _time(fn, seconds: float) -> float:
    return Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=seconds).median


def run_shape(name: str, seconds: float) -> dict:
    w = SHAPES[name]
    results = {}
    expect = None
    for label, path in (("flexkv", "auto"), ("flexkv/flex", "flex")):
        st = Steady(w)
        st.manager.attention_path = path
        t0 = time.perf_counter()
        flex = FlexKV(st, "layer")
        compile_s = time.perf_counter() - t0
        with torch.no_grad():
            out = flex.step(st.inputs[0])
        if expect is None:
            expect = [o.clone() for o in out]
            dense = CatSlice(st)
            err = check(expect, dense.step(st.inputs[0]), "dense")
        else:
            err = check(expect, out, label)
        i = {"i": 0}

        def one():
            i["i"] += 1
            with torch.no_grad():
                flex.step(st.inputs[i["i"] % len(st.inputs)])

        flex.plan_s.clear()
        ms = _time(one, seconds) * 1e3
        plan_ms = sorted(flex.plan_s)[len(flex.plan_s) // 2] * 1e3
        results[label] = dict(ms=ms, plan_ms=plan_ms, compile_s=compile_s, err=err,
                              block=st.manager.layout.block_size,
                              path="rows" if st.manager._rows_path(st.T) else "flex")
        if label == "flexkv":
            j = {"i": 0}

            def dense_one():
                j["i"] += 1
                with torch.no_grad():
                    dense.step(st.inputs[j["i"] % len(st.inputs)])

            results["dense"] = dict(ms=_time(dense_one, seconds) * 1e3, err=0.0)
    return results


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--seconds", type=float, default=2.0, help="timing budget per implementation")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    head = ("shape", "flexkv ms", "path, block", "plan ms", "flexkv/flex ms", "dense ms",
            "dense / flexkv", "dense / flexkv-flex")
    rows = []
    for name in args.shapes.split(","):
        r = run_shape(name, args.seconds)
        f, ff, d = r["flexkv"], r["flexkv/flex"], r["dense"]
        rows.append((name, f"{f['ms']:.2f}", f"{f['path']}, {f['block']}", f"{f['plan_ms']:.3f}",
                     f"{ff['ms']:.2f}", f"{d['ms']:.2f}", f"{d['ms'] / f['ms']:.2f}x", f"{d['ms'] / ff['ms']:.2f}x"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        for r in (head, *rows):
            print("  ".join(str(x).rjust(wd) for x, wd in zip(r, widths)))


if __name__ == "__main__":
    main()
