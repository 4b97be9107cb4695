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
"""

from __future__ import annotations

import argparse
import gc

import torch

from benchmarks.chunked import SHAPES
from benchmarks.impls import FlexKV, Steady, check
from benchmarks.timing import cycle, interleaved
from flexkv.cache import quantized

MODES = ("eager", "compiled")


def _fill(st: Steady, reference: Steady, seed: int) -> None:
    """Give `st`'s cache random cells (quantized when its slots are) and `reference`'s cache exactly
    what `st`'s reads back, so both compute the same attention."""
    g = torch.Generator().manual_seed(seed)
    m, r = st.manager, reference.manager
    sd, dt = m.config.slot_dtype, m.config.dtype
    with torch.no_grad():
        for l in range(m.config.num_layers):
            for i, (buf, ref_buf) in enumerate(zip(m._layer_kv(l), r._layer_kv(l))):
                x = torch.randn(buf.shape, generator=g).to(dt)
                if sd is None:
                    buf.copy_(x)
                    ref_buf.copy_(x)
                    continue
                cells, scale = quantized.quantize(x, sd)
                buf.copy_(cells)
                m._layer_scales(l)[i].copy_(scale)
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


def run_shape(name: str, slot_dtypes, modes, rounds: int, paths: bool) -> dict:
    base = SHAPES[name]
    rows = {}
    for mode in modes:
        variants, runners, errs = {}, {}, {}
        for sd in slot_dtypes:
            for path in (("auto", "rows", "flex") if paths and mode == "compiled" and sd != "none" else ("auto",)):
                st, twin = Steady(base.replace(slot_dtype=sd), path=path), Steady(base)
                _fill(st, twin, 0)
                st.inputs = twin.inputs = _stored_inputs(st, st.inputs)
                runner = Eager(st) if mode == "eager" else FlexKV(st, "layer")
                with torch.no_grad():
                    # The unquantized twin holds what the quantized cells read back: the same attention.
                    want = Eager(twin).step(st.inputs[0])
                    errs[(sd, path)] = check(want, runner.step(st.inputs[0]), f"{mode} {sd} {path}")
                variants[(sd, path)], runners[(sd, path)] = st, runner
                del twin
        times = interleaved({key: cycle(r.step, variants[key].inputs) for key, r in runners.items()}, rounds=rounds)
        unq = times[("none", "auto")]["median_ms"]
        for key, st in variants.items():
            m = st.manager
            rows[(mode,) + key] = dict(ms=times[key]["median_ms"], ratio=times[key]["median_ms"] / unq,
                                       path=m.path_for(st.T, compiled=mode == "compiled"),
                                       slot_bytes=m.slot_bytes, err=errs[key])
        del runners, variants
        gc.collect()
    return rows


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
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    slot_dtypes = args.slot_dtypes.split(",")
    if slot_dtypes[0] != "none":
        slot_dtypes = ["none"] + [s for s in slot_dtypes if s != "none"]
    results = {}
    for name in args.shapes.split(","):
        results[name] = run_shape(name, slot_dtypes, args.modes.split(","), args.rounds, args.paths)
        print(f"  {name}: done", flush=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), medians of {args.rounds} interleaved "
          f"rounds; ratio: to the unquantized cache of the same mode")
    head = ("shape", "mode", "slots", "path", "ms", "ratio", "stream bytes", "first-step diff")
    lines = []
    for name, rows in results.items():
        for (mode, sd, path), r in rows.items():
            label = r["path"] if path == "auto" else f"{r['path']} (forced)"
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
