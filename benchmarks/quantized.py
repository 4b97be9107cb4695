"""Quantized slots against unquantized ones: the same shapes and inputs, side by side in one process.

Shapes (`benchmarks.chunked.SHAPES`, fp32 model dtype, attention only: write + attention of
every layer; every stream far past its window): `decode` (32 requests, 8 heads x 64, 4 sinks +
window 1020), `decode-gqa4` (the same with 32 query heads), and the chunked shapes `encoder`
(T 14, window 70), `gqa-d128` (T 32, 4 KV heads x 128, 2-way GQA), `prefill` (T 32, per-query
window 256, 4-way GQA).

For each shape and each `--slot-dtypes` entry (`none`: cells in the model's dtype; `int8`;
`fp8`), one cache holds the same random content (the quantized caches' cells are that content
quantized; the unquantized cache holds their dequantized copy, so all of them compute the same
attention) and runs the same steps: host admit + plan, `attend` per layer (`eager`: called
directly; `compiled`: one compiled function per layer, every setting left to flexkv), commit.
The first step of every cache is checked against the unquantized one before timing. Each row
reports the median of `benchmarks.timing.interleaved` rounds, the ratio to the unquantized
cache of the same mode, and the bytes one stream holds (`slot_bytes`).

    python -m benchmarks.quantized --threads 1                      # eager and compiled, all shapes
    python -m benchmarks.quantized --threads 1 --modes eager        # eager only (no compile time)
    python -m benchmarks.quantized --threads 1 --paths              # compiled: rows and flex paths too
    python -m benchmarks.quantized --threads 1 --widen              # the widening passes of one group alone
    python -m benchmarks.quantized --threads 1 --cpu-time           # thread CPU time (a machine others share)
    python -m benchmarks.quantized --threads 1 --plain              # also with cpu_fast_paths=False

`--widen` times what reading one group of cells costs at the `decode` shape (the keys of one slot
row: 8 heads x 1024 cells x 64, read in place from a pool of 32 rows) for each cell dtype, pass
by pass: int8's one copy to float32 against float8's int8-to-int16 copy, shift, mask and float16
conversion (`quantized.widen_into`), the same through float32 bits (four passes over four-byte
numbers), and torch's own float8 conversion.

`--plain` adds, for every cache, the same cache with `AttentionOptions(cpu_fast_paths=False)`
(path `plain`): the rows path's plain reference (`row_attention.attend_rows`) in place of its CPU
fast paths (`flexkv.cache.cpu.cpu_fast_rows`), side by side with them.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from benchmarks.chunked import SHAPES
from benchmarks.impls import FlexKV, Steady, check
from benchmarks.timing import cycle, interleaved
from flexkv.cache.storage import quantized

MODES = ("eager", "compiled")


def _fill(st: Steady, reference: Steady, seed: int) -> None:
    """Give `st`'s cache random cells (quantized when its slots are) and `reference`'s cache exactly
    what `st`'s reads back, so both compute the same attention."""
    g = torch.Generator().manual_seed(seed)
    m, r = st.manager, reference.manager
    sd, dt = m.config.slot_dtype, m.config.dtype
    with torch.no_grad():
        for l in range(m.config.num_layers):
            for i, (buf, ref_buf) in enumerate(zip(m.store.layer_kv(l), r.store.layer_kv(l))):
                x = torch.randn(buf.shape, generator=g).to(dt)
                if sd is None:
                    buf.copy_(x)
                    ref_buf.copy_(x)
                    continue
                cells, scale = quantized.quantize(x, sd)
                buf.copy_(cells)
                m.store.layer_scales(l)[i].copy_(scale)
                ref_buf.copy_(quantized.dequantize(cells, scale, dt))


class Eager:
    """Admit + plan, `attend` per layer called directly, commit."""

    def __init__(self, st: Steady):
        self.st = st

    def step(self, inputs):
        st, m = self.st, self.st.manager
        s = st.step()
        m.admit(s)
        plan = m.plan(s)
        with torch.no_grad():
            out = [m.attend(l, *inputs[l], plan) for l in range(st.w.layers)]
        m.commit(s)
        st.written = [x + st.span for x in st.written]
        return out


def _stored_inputs(st: Steady, inputs) -> list:
    """`inputs` with the keys and values as `st`'s cache stores them (themselves when unquantized)."""
    sd = st.manager.config.slot_dtype
    return [[(q, quantized.round_trip(k, sd), quantized.round_trip(v, sd)) for q, k, v in layers]
            for layers in inputs]


def run_shape(name: str, slot_dtypes, modes, rounds: int, paths: bool, clock=time.perf_counter,
              plain: bool = False) -> dict:
    base = SHAPES[name]
    rows = {}
    for mode in modes:
        variants, runners, errs = {}, {}, {}
        for sd in slot_dtypes:
            kinds = ("auto", "rows", "flex") if paths and mode == "compiled" and sd != "none" else ("auto",)
            for path in kinds + (("plain",) if plain else ()):
                st = Steady(base.replace(slot_dtype=sd), path="auto" if path == "plain" else path,
                            fast=path != "plain")
                twin = Steady(base)
                _fill(st, twin, 0)
                st.inputs = twin.inputs = _stored_inputs(st, st.inputs)
                runner = Eager(st) if mode == "eager" else FlexKV(st, "layer")
                with torch.no_grad():
                    # The unquantized twin holds what the quantized cells read back: the same attention.
                    want = Eager(twin).step(st.inputs[0])
                    errs[(sd, path)] = check(want, runner.step(st.inputs[0]), f"{mode} {sd} {path}")
                variants[(sd, path)], runners[(sd, path)] = st, runner
                del twin
        times = interleaved({key: cycle(r.step, variants[key].inputs) for key, r in runners.items()}, rounds=rounds,
                            clock=clock)
        unq = times[("none", "auto")]["median_ms"]
        for key, st in variants.items():
            m = st.manager
            rows[(mode,) + key] = dict(ms=times[key]["median_ms"], ratio=times[key]["median_ms"] / unq,
                                       path=m.path_for(st.T, compiled=mode == "compiled"),
                                       slot_bytes=m.slot_bytes, err=errs[key])
        del runners, variants
        gc.collect()
    return rows


def _float8_through_float32_bits(out: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    """The other exact widening, for comparison: the cell's bits shifted into float32's (the number
    times 2**-120), then the 2**120 multiplied back (it cannot join the scale, which it may overflow)."""
    bits = out.view(torch.int32)
    bits.copy_(cells.view(torch.int8))
    bits.mul_(1 << 20).bitwise_and_(-0x78100000)
    return out.mul_(2.0 ** 120)


def widen_passes(rounds: int, clock=time.perf_counter) -> None:
    """Per-pass times of widening one decode group (`--widen`), interleaved, medians of rounds."""
    heads, rows, row_len, dim = 8, 32, 1024, 64
    x = torch.randn(1, heads, rows * row_len, dim, generator=torch.Generator().manual_seed(0))
    pools = {sd: quantized.quantize(x, sd)[0] for sd in (torch.int8, torch.float8_e4m3fn)}
    out = torch.empty(heads, row_len, dim)
    staging = torch.empty(heads, row_len, dim, dtype=torch.int16)

    def group(sd, b):
        return pools[sd][0, :, b * row_len:(b + 1) * row_len]

    def rows_of(fn):
        return lambda: [fn(b) for b in range(rows)]

    passes = {
        "int8: copy to float32": lambda b: out.copy_(group(torch.int8, b)),
        "float8: whole widening": lambda b: quantized.widen_into(out, group(torch.float8_e4m3fn, b), staging),
        "float8: int8 -> int16 copy": lambda b: staging.copy_(group(torch.float8_e4m3fn, b).view(torch.int8)),
        "float8: shift (multiply)": lambda b: staging.mul_(1 << quantized._F8_TO_F16_SHIFT),
        "float8: mask": lambda b: staging.bitwise_and_(quantized._F8_TO_F16_MASK),
        "float8: float16 -> float32": lambda b: out.copy_(staging.view(torch.float16)),
        "float8 through float32 bits": lambda b: _float8_through_float32_bits(out, group(torch.float8_e4m3fn, b)),
    }
    times = interleaved({name: rows_of(fn) for name, fn in passes.items()}, rounds=rounds, clock=clock)
    cells = heads * row_len * dim
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), medians of {rounds} interleaved rounds; "
          f"one group: {cells:,} cells")
    for name, t in times.items():
        ms = t["median_ms"] / rows
        print(f"  {name:28s} {ms:7.3f} ms per group  {ms * 1e6 / cells:6.3f} ns per cell")
    slow = interleaved({"float8: torch .to(float32)": lambda: out.copy_(group(torch.float8_e4m3fn, 0))}, rounds=3,
                       clock=clock)
    ms = slow["float8: torch .to(float32)"]["median_ms"]
    print(f"  {'float8: torch .to(float32)':28s} {ms:7.3f} ms per group  {ms * 1e6 / cells:6.3f} ns per cell")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--shapes", default="decode,decode-gqa4,encoder,gqa-d128,prefill",
                    help="comma-separated subset of " + ",".join(SHAPES))
    ap.add_argument("--slot-dtypes", default="none,int8,fp8", help="comma-separated: none, int8, fp8")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    ap.add_argument("--paths", action="store_true", help="compiled quantized caches: also time options path "
                                                          "'rows' and 'flex'")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--plain", action="store_true", help="also time every cache with cpu_fast_paths=False")
    ap.add_argument("--widen", action="store_true", help="time only the widening passes of one decode group")
    ap.add_argument("--cpu-time", action="store_true", help="time the calling thread's CPU time instead of wall "
                                                            "time (with --threads 1, on a machine other jobs share)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    if args.widen:
        widen_passes(args.rounds, clock)
        return
    slot_dtypes = args.slot_dtypes.split(",")
    if slot_dtypes[0] != "none":
        slot_dtypes = ["none"] + [s for s in slot_dtypes if s != "none"]
    results = {}
    for name in args.shapes.split(","):
        results[name] = run_shape(name, slot_dtypes, args.modes.split(","), args.rounds, args.paths, clock,
                                  args.plain)
        print(f"  {name}: done", flush=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), medians of {args.rounds} interleaved "
          f"rounds of {'thread CPU' if args.cpu_time else 'wall'} time; ratio: to the unquantized cache of the same mode")
    head = ("shape", "mode", "slots", "path", "ms", "ratio", "stream bytes", "first-step diff")
    lines = []
    for name, rows in results.items():
        for (mode, sd, path), r in rows.items():
            label = r["path"] if path == "auto" else f"{r['path']} (plain)" if path == "plain" \
                else f"{r['path']} (forced)"
            lines.append((name, mode, sd, label, f"{r['ms']:.2f}", f"{r['ratio']:.2f}x", f"{r['slot_bytes']:,}",
                          f"{r['err']:.1g}"))
    if args.markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        print("\n".join("| " + " | ".join(x) + " |" for x in lines))
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
        print("\n".join("  ".join(str(x).rjust(wd) for x, wd in zip(r, widths)) for r in (head, *lines)))


if __name__ == "__main__":
    main()
