"""Print the ratio table from a pytest-benchmark JSON file written by `benchmarks/test_bench.py`.

    python -m benchmarks.report bench.json [--markdown]

One row per workload: the median step time of each implementation, how much
faster flexkv is than the fastest baseline, flexkv's ratio to the floor (the
floor measured right after flexkv's rounds), its achieved GB/s, host planning
as a share of the step, and compile time.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List

IMPLS = ["flexkv", "gather", "cat-slice", "unbounded", "floor"]
BASELINES = ["gather", "cat-slice", "unbounded"]


def collect(data: dict) -> Dict[str, Dict[str, dict]]:
    """workload -> impl -> {"median_s": ..., **extra_info}, from pytest-benchmark's JSON."""
    out: Dict[str, Dict[str, dict]] = {}
    for b in data.get("benchmarks", []):
        info = b.get("extra_info", {})
        params = b.get("params") or {}
        workload = info.get("workload", params.get("workload"))
        impl = info.get("impl", params.get("impl"))
        if workload is None or impl is None:
            continue
        out.setdefault(workload, {})[impl] = dict(info, median_s=b["stats"]["median"])
    return out


def rows(table: Dict[str, Dict[str, dict]]) -> List[dict]:
    """The figures of each workload's row (missing implementations are None)."""
    result = []
    for workload, impls in table.items():
        ms = {k: (impls[k]["median_s"] * 1e3 if k in impls else None) for k in IMPLS}
        flex = impls.get("flexkv", {})
        base = {k: ms[k] for k in BASELINES if ms[k] is not None}
        best = min(base, key=base.get) if base else None
        result.append({
            "workload": workload,
            "threads": flex.get("threads"),
            "ms": ms,
            "best_baseline": best,
            "speedup": (base[best] / ms["flexkv"]) if best and ms["flexkv"] else None,
            "vs_floor": flex.get("ratio_to_floor"),
            "gb_per_s": flex.get("gb_per_s"),
            "plan_pct": 100 * flex["plan_fraction"] if "plan_fraction" in flex else None,
            "compile_s": flex.get("compile_s"),
            "mb_per_step": flex.get("bytes_per_step", 0) / 1e6 if flex else None,
        })
    return result


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def render(data: dict, markdown: bool = False) -> str:
    rs = rows(collect(data))
    head = ["workload", "flexkv ms", "gather ms", "cat-slice ms", "unbounded ms", "floor ms",
            "vs best baseline", "flexkv/floor", "GB/s", "plan %", "compile s"]
    body = []
    for r in rs:
        ms = r["ms"]
        speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x ({r['best_baseline']})"
        body.append([r["workload"]] + [_f(ms[k], ".2f") for k in IMPLS] + [
            speed, _f(r["vs_floor"], ".2f"), _f(r["gb_per_s"], ".1f"), _f(r["plan_pct"], ".1f"),
            _f(r["compile_s"], ".1f")])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = lambda row: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(row) for row in body])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="?", default="bench.json", help="pytest-benchmark JSON (default: bench.json)")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = p.parse_args(argv)
    try:
        with open(args.json, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        print(f"benchmarks.report: cannot read {args.json}: {e}", file=sys.stderr)
        return 2
    if not collect(data):
        print(f"benchmarks.report: {args.json} holds no flexkv benchmark results", file=sys.stderr)
        return 2
    print(render(data, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
