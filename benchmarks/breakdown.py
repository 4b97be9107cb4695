"""Where a chunked step's time goes on the rows path: write, geometry, gather, kernel, and the rest.

For one shape of `benchmarks.chunked`, every piece of `BoundedKVManager.attend`'s rows path is
compiled on its own and timed over all the step's layers (each layer's keys and values, so no
piece reads a cache another piece just warmed), interleaved with the whole compiled `attend`
and with SDPA over the same entries already laid out (`benchmarks.impls.LaidOut`):

- `write`: the step's keys and values into the layer tensors (two `index_put_`);
- `geometry`: the plan's cells, the mask as an additive bias, which queries read anything
  (`flexkv.cache.cpu.cpu_fast_rows.geometry`);
- `kernel`: SDPA on the rows path's own inputs (the slot pool in place, or the gathered block),
  with the bias;
- `rows path`: `flexkv.cache.cpu.cpu_fast_rows.attend` with the geometry given: for gathered rows the
  gather and the kernel, in place the query gather, the kernel and the read-back;
- `attend`: all of it, as shipped.

    python -m benchmarks.breakdown --shape dit --threads 1

A gathered block is a fresh allocation per layer (tens of MB at the `dit` shape); when the C
allocator hands it out as newly mapped pages, first touching them costs as much as the copy.
glibc raises its mmap threshold as such blocks are freed, so this varies within a run; pin it
(`MALLOC_MMAP_THRESHOLD_=4294967296`) to see the steady cost.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.chunked import SHAPES
from benchmarks.impls import LaidOut, Steady, check
from benchmarks.timing import interleaved
from flexkv.cache.cpu.cpu_fast_rows import attend
from flexkv.cache.cpu.cpu_fast_rows import geometry as fast_geometry
from flexkv.cache.paths.row_attention import gather_width
from flexkv.cache.positions.masks import make_mask_mod


def run(name: str, rounds: int) -> dict:
    st = Steady(SHAPES[name])
    m, lay, c = st.manager, st.manager.layout, st.manager.config
    plan = m.plan(st.step())
    inputs = st.inputs[0]
    L = len(inputs)
    N, H, T, D = inputs[0][1].shape
    g = inputs[0][0].shape[1] // H
    Q = g * T

    def geometry(plan):
        mask_mod = make_mask_mod(plan, lay.ring_len, T, c.query_window, pack_gqa=g > 1)
        return fast_geometry(lay, plan, mask_mod, Q, inputs[0][0].dtype, gather_width(c), m.store.memos)

    with torch.no_grad():
        geo = geometry(plan)

    def write(l, k, v, plan):
        m.store.write(l, k, v, plan)

    def gather(kc, vc, cells):
        W = cells.shape[1]
        flat = cells.reshape(-1)
        return (kc[0].index_select(1, flat).view(H, -1, W, D).transpose(0, 1),
                vc[0].index_select(1, flat).view(H, -1, W, vc.shape[-1]).transpose(0, 1))

    def kv_of(l):
        kc, vc = m.store.layer_kv(l)
        if not geo.in_place:
            return gather(kc, vc, geo.cells)
        n_slot, Lr, base = lay.max_slots * lay.rows_per_request, lay.slot_row_len, lay.slots_base
        return (kc[0, :, base:base + n_slot * Lr].view(H, n_slot, Lr, D).transpose(0, 1),
                vc[0, :, base:base + n_slot * Lr].view(H, n_slot, Lr, vc.shape[-1]).transpose(0, 1))

    with torch.no_grad():
        for l, (q, k, v) in enumerate(inputs):  # the step's own keys and values in place, as attend leaves them
            write(l, k, v, plan)
        kvs = [tuple(t.contiguous() if not geo.in_place else t for t in kv_of(l)) for l in range(L)]
        qs = [(q.reshape(N, H, Q, D) * D ** -0.5).index_select(0, geo.batch_rows) if geo.in_place
              else q.reshape(N, H, Q, D) * D ** -0.5 for q, _, _ in inputs]
    cw = torch.compile(write, fullgraph=True, dynamic=False)
    cg = torch.compile(geometry, fullgraph=True, dynamic=False)
    qs_plain = [q.reshape(N, H, Q, D) * D ** -0.5 for q, _, _ in inputs]
    rows = [torch.compile(lambda q, p, l=l: attend(q, *m.store.layer_kv(l), lay, p, None, geo=geo),
                          fullgraph=True, dynamic=False) for l in range(L)]
    attends = [torch.compile(lambda q, k, v, p, l=l: m.attend(l, q, k, v, p), fullgraph=True, dynamic=False)
               for l in range(L)]
    laid = LaidOut(st, inputs)
    fns = {
        "attend": lambda: [attends[l](q, k, v, plan) for l, (q, k, v) in enumerate(inputs)],
        "write": lambda: [cw(l, k, v, plan) for l, (_, k, v) in enumerate(inputs)],
        "geometry": lambda: [cg(plan) for _ in range(L)],
        "kernel": lambda: [F.scaled_dot_product_attention(qs[l], *kvs[l], attn_mask=geo.bias, scale=1.0)
                           for l in range(L)],
        "laid-out": lambda: laid.step(inputs),
    }
    fns["rows path"] = lambda: [rows[l](qs_plain[l], plan) for l in range(L)]

    def by_row(out):
        """The timed kernel's output of one layer read back into the plan's rows, as attend returns it."""
        if geo.in_place:
            out = out.index_select(0, geo.back)
        return torch.where(geo.row_reads.unsqueeze(-1), out, 0.0)

    with torch.no_grad():  # every timed piece computes what attend computes
        want = [o.clone() for o in fns["attend"]()]
        check(want, [r.view_as(w) for r, w in zip(fns["rows path"](), want)], "rows path")
        check(want, [by_row(o).view_as(w) for o, w in zip(fns["kernel"](), want)], "kernel")
        check(want, laid.step(inputs), "laid-out")
        times = interleaved(fns, rounds=rounds)
    return dict(times=times, in_place=geo.in_place, layers=L)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="dit", choices=[s for s, w in SHAPES.items() if w.step_tokens > 1])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    r = run(args.shape, args.rounds)
    t = r["times"]
    lim = t["laid-out"]["median_ms"]
    print(f"{args.shape}: {'in place' if r['in_place'] else 'gathered'}, {r['layers']} layers, torch "
          f"{torch.__version__}, {torch.get_num_threads()} thread(s); ms per step (all layers), medians")
    for k, x in t.items():
        print(f"  {k:10s} {x['median_ms']:8.2f} ms  {x['median_ms'] / lim:5.2f}x laid-out")


if __name__ == "__main__":
    main()
