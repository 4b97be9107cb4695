"""Compiled chunked steps and decode against their limits, side by side in one process.

Shapes (fp32, attention only: write + attention of every layer; every stream far past its window):

- `encoder`: a streaming speech encoder; 32 rows, chunks of T 14 (all written), window 70,
  no sink, 4 layers, 8 heads x 64;
- `dit`: a flow-matching DiT; 8 requests x 2 CFG rows, chunks of T 50 joining the stream in
  reverse order, a shared 300-entry source of which 100 are sinks, window 300, 4 layers,
  8 heads x 64;
- `gqa-d128`: 16 requests, 4 KV heads x 128 with 2-way GQA (8 query heads), 4 sinks + window
  500, chunks of T 32, 4 layers;
- `prefill`: chunked prefill with a per-query window: 16 requests, 32 query / 8 KV heads x 64
  (4-way GQA), 4 sinks + query window 256, chunks of T 32, 4 layers;
- `decode`: 32 requests, 8 heads x 64 (no GQA), 4 sinks + window 1020, 4 layers;
- `decode-gqa4`: the same with 32 query heads (4-way GQA).

Each shape runs, in one `benchmarks.timing.interleaved` loop (rounds of every variant in turn):

- `flexkv`: host admit + plan, then one compiled `attend` per layer, then commit, with every
  setting left to flexkv (block size, attention path);
- `flexkv/flex` (with `--flex`): the same with `AttentionOptions(path="flex")`;
- `laid-out`: SDPA over each row's retained entries and the step's tokens already contiguous,
  with the retention mask: no write and no copy, the limit of any layout with this kernel (the
  limit the table divides chunked steps by);
- `floor` (decode): one read (a sum) of the bytes the step must read (the limit the table
  divides decode by);
- `dense`: a per-request contiguous cache: `torch.cat` of the step, one batched SDPA, slice
  back to sink + window;
- `gather` (decode, with `--gather`): per row, concatenate the retained ranges of a ring, SDPA.

The first step of every implementation is checked against flexkv's.

    python -m benchmarks.chunked --threads 1             # the table
    python -m benchmarks.chunked --threads 1 --markdown  # the same, for docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from benchmarks.impls import CatSlice, FlexKV, Floor, Gather, LaidOut, Steady, check
from benchmarks.timing import cycle, interleaved
from flexkv.cli.workload import Workload

SHAPES = {
    "encoder": Workload(name="encoder", layers=4, kv_heads=8, head_dim=64, window=70, span=14, tokens=14,
                        requests=32, stream_len=(140, 1400)),
    "dit": Workload(name="dit", layers=4, kv_heads=8, head_dim=64, window=300, rows=2, source_len=300,
                    sources=2, sink=100, reverse_step_order=True, span=50, tokens=50, requests=8,
                    stream_len=(300, 1500)),
    "gqa-d128": Workload(name="gqa-d128", layers=4, kv_heads=4, q_heads=8, head_dim=128, sink=4, window=500,
                         span=32, tokens=32, requests=16, stream_len=(600, 3000)),
    "prefill": Workload(name="prefill", layers=4, kv_heads=8, q_heads=32, head_dim=64, sink=4, window=256,
                        query_window=256, span=32, tokens=32, requests=16, stream_len=(600, 3000)),
    "decode": Workload(name="decode", layers=4, kv_heads=8, head_dim=64, sink=4, window=1020, span=1,
                       requests=32, stream_len=(600, 3000)),
    "decode-gqa4": Workload(name="decode-gqa4", layers=4, kv_heads=8, q_heads=32, head_dim=64, sink=4,
                            window=1020, span=1, requests=32, stream_len=(600, 3000)),
}


def _path(manager, tokens: int) -> str:
    """The path a compiled step of `tokens` tokens takes (earlier versions had only `_rows_path`)."""
    if hasattr(manager, "path_for"):
        return manager.path_for(tokens, compiled=True)
    return "rows" if manager._rows_path(tokens) else "flex"


def run_shape(name: str, rounds: int, flex: bool = False, gather: bool = False) -> dict:
    w = SHAPES[name]
    decode = w.step_tokens == 1
    st = Steady(w)
    t0 = time.perf_counter()
    fk = FlexKV(st, "layer")
    compile_s = time.perf_counter() - t0
    first = st.inputs[0]
    with torch.no_grad():
        expect = [o.clone() for o in fk.step(first)]
    fns = {"flexkv": cycle(fk.step, st.inputs)}
    info = dict(block=st.manager.layout.block_size, compile_s=compile_s,
                path=_path(st.manager, st.T))
    errs = {}
    others = []
    if flex:
        st2 = Steady(w, path="flex")
        fk2 = FlexKV(st2, "layer")
        with torch.no_grad():
            errs["flexkv/flex"] = check(expect, fk2.step(first), "flexkv/flex")
        fns["flexkv/flex"] = cycle(fk2.step, st2.inputs)
        others.append(st2)
    if decode:
        fns["floor"] = cycle(Floor(st).step, st.inputs)
    laid = LaidOut(st, first)
    with torch.no_grad():
        errs["laid-out"] = check(expect, laid.step(first), "laid-out")
    # The laid-out keys hold the first round's own tokens: time it on that round only.
    fns["laid-out"] = cycle(laid.step, [first])
    dense = CatSlice(st)
    with torch.no_grad():
        errs["dense"] = check(expect, dense.step(first), "dense")
    fns["dense"] = cycle(dense.step, st.inputs)
    if gather:
        g = Gather(st)
        with torch.no_grad():
            errs["gather"] = check(expect, g.step(first), "gather")
        fns["gather"] = cycle(g.step, st.inputs)
    fk.plan_s.clear()
    times = interleaved(fns, rounds=rounds)
    info["plan_ms"] = sorted(fk.plan_s)[len(fk.plan_s) // 2] * 1e3
    del others
    gc.collect()
    return dict(times=times, errs=errs, info=info, decode=decode)


def table(results: dict, markdown: bool) -> str:
    head = ("shape", "flexkv ms", "path, block", "plan ms", "limit", "limit ms", "flexkv / limit",
            "dense ms", "dense / flexkv", "others")
    rows = []
    for name, r in results.items():
        t, i = r["times"], r["info"]
        f = t["flexkv"]["median_ms"]
        lim = "floor" if r["decode"] else "laid-out"
        extra = ", ".join(f"{k} {v['median_ms']:.2f} (flexkv / it {f / v['median_ms']:.2f}x)" for k, v in t.items()
                          if k not in ("flexkv", lim, "dense"))
        rows.append((name, f"{f:.2f}", f"{i['path']}, {i['block']}", f"{i['plan_ms']:.3f}", lim,
                     f"{t[lim]['median_ms']:.2f}", f"{f / t[lim]['median_ms']:.2f}x", f"{t['dense']['median_ms']:.2f}",
                     f"{t['dense']['median_ms'] / f:.2f}x", extra or "-"))
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(out)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(str(x).rjust(wd) for x, wd in zip(r, widths)) for r in (head, *rows))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per shape (median reported)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--flex", action="store_true", help="also time AttentionOptions path='flex'")
    ap.add_argument("--gather", action="store_true", help="also time per-row gather + SDPA")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    for name in args.shapes.split(","):
        results[name] = run_shape(name, args.rounds, args.flex, args.gather)
        print(f"  {name}: done ({results[name]['info']['compile_s']:.1f} s compile)", flush=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), medians of {args.rounds} interleaved rounds")
    print(table(results, args.markdown))


if __name__ == "__main__":
    main()
