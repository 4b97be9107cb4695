"""Host planning cost against the step's size, not the pool's: rows x window.

Each point plans one decode step of `rows` requests, each far past its window
(rings wrapped), on a `"meta"` cache (nothing allocated; the plan is exactly
the CUDA plan, with CUDA's full blocks), shaped like a 32-layer model with 8
KV heads of 128 in bf16 and 4 sinks. It reports the best of 30 planning times
(and the median), the time per row and the size of the plan table.

    python -m benchmarks.planning                 # the curve, as a table
    python -m benchmarks.planning --markdown      # the same, for docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import torch

from flexkv import BoundedKVConfig, BoundedKVManager, BoundedKVStep, Segment, SinkWindow, StreamPosition
from flexkv.cache.paths.attention_options import AttentionOptions

ROWS = (1, 16, 64, 256)
WINDOWS = (1020, 4092, 16380)


def plan_time(rows: int, window: int, *, full_blocks: bool = True, repeats: int = 30) -> dict:
    """Planning one decode step of `rows` requests with a sink-4 `window`: the best of `repeats`
    (`ms`, `us_per_row`; the fairest figure on a shared machine) and the median (`median_ms`)."""
    cfg = BoundedKVConfig(
        num_layers=32, num_heads=8, head_dim=128, rows_per_request=1, max_source_len=0, max_sources=0,
        retention=SinkWindow(4, window), max_slots=rows, max_step_tokens=1, dtype=torch.bfloat16,
    )
    m = BoundedKVManager(cfg, "meta", options=AttentionOptions.for_cache(cfg, "meta", full_blocks=full_blocks))
    ids = list(range(rows))
    m.admit(BoundedKVStep(tuple(Segment(r, 1) for r in ids), {r: StreamPosition(0, 0) for r in ids}))
    # Streams far past the window, at different ring phases.
    step = BoundedKVStep(
        tuple(Segment(r, 1) for r in ids),
        {r: StreamPosition(0, 5 * window + 37 * r) for r in ids},
    )
    plan = m.plan(step)
    times = timeit.repeat(lambda: m.plan(step), number=1, repeat=repeats)
    best = min(times)
    return dict(rows=rows, window=window, ms=best * 1e3, us_per_row=best * 1e6 / rows,
                median_ms=statistics.median(times) * 1e3,
                table_kb=len(plan.host) / 1024, width=plan.width, pool_blocks=m.layout.num_blocks,
                cache_gb=m.config.num_layers * 2 * m.layout.total_len * 8 * 128 * 2 / 1e9)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    head = ("rows", "window", "plan ms", "median ms", "us/row", "table KB", "blocks/row", "pool blocks",
            "cache GB")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    else:
        print("  ".join(f"{h:>11}" for h in head))
    for window in WINDOWS:
        for rows in ROWS:
            r = plan_time(rows, window)
            vals = (r["rows"], r["window"], f"{r['ms']:.3f}", f"{r['median_ms']:.3f}", f"{r['us_per_row']:.1f}",
                    f"{r['table_kb']:.1f}",
                    r["width"], r["pool_blocks"], f"{r['cache_gb']:.1f}")
            if args.markdown:
                print("| " + " | ".join(str(v) for v in vals) + " |")
            else:
                print("  ".join(f"{v!s:>11}" for v in vals))


if __name__ == "__main__":
    main()
