"""The vLLM plugin's GPU path on a device, with torch alone: `benchmarks/cuda_check.py`'s paged section.

    python -m benchmarks.cuda_paged [--cpu] [--json PATH]

What vLLM's FlexAttention backend computes for flexkv (`flexkv.integrations.vllm.paged`: the retention's
block mask over a paged cache built from the block table, and in-cache positions as sink scores put in by a
`score_mod`) is run as one compiled function per layer, `attend`, over a paged cache laid out as vLLM lays
it (keys rotated at stream indices, blocks wholly between a request's sinks and its window freed to the
null block, which holds garbage), and checked:

1. against a dense float64 reference written from docs/vllm.md's sentence, not from the code: the query at
   stream index `p` attends the sinks `j < sink` and `p - window <= j <= p`; with in-cache positions every
   entry past the sinks moves down by `e = max(0, p - sink - window)`, so the query sits at `p - e`, a sink
   at `j` and a window entry at `j - e` (the reference rotates raw queries and keys at those positions);
   in fp32 and bf16, both position modes, a batch of decoding requests and prompt chunks;
2. recompiles over steps of 1, 8, 64 and 512 query tokens (`attend` compiled with dynamic shapes; the
   first step compiles, the next may compile once more as shapes go dynamic, then none);
3. on CUDA, a CUDA graph captured over padded query rows and replayed with new content (other positions,
   another block table), the real rows against the reference;
4. decode time against a plain sliding window of the same size (`sink + window + 1` keys, no sinks, no
   `score_mod`) at 4k, 32k and 128k stream positions (CUDA events; on the CPU, tiny shapes and
   `torch.utils.benchmark`).

On the CPU (CI runs it: tests/test_cuda_check.py) the shapes are tiny and the CUDA graph is skipped.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from typing import NamedTuple, Optional

import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import flex_attention

from benchmarks.timing import device_ms
from flexkv.compiling import fresh_function
from flexkv.integrations.vllm.paged import (
    PagedBatch,
    in_cache_score_mod,
    logical_kv_index,
    paged_batch,
    physical_to_logical,
    query_positions,
    retention_block_mask,
    sink_scores,
)

#: norm-relative tolerance, `||out - ref|| / ||ref||`
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
BASE = 10000.0


class Shape(NamedTuple):
    sink: int
    window: int
    kv_heads: int
    group: int
    head_dim: int
    block_size: int
    q_block: int


def shape_for(cuda: bool) -> Shape:
    if cuda:
        return Shape(sink=4, window=4092, kv_heads=8, group=4, head_dim=128, block_size=16, q_block=16)
    return Shape(sink=4, window=28, kv_heads=2, group=2, head_dim=16, block_size=16, q_block=16)


def rotary_table(positions: int, rotary_dim: int, device) -> torch.Tensor:
    """`[positions, rotary_dim]` float32: cosines then sines, vLLM's `cos_sin_cache` layout."""
    inv = 1.0 / BASE ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv
    return torch.cat((ang.cos(), ang.sin()), -1).float().to(device)


def rotate64(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """`x` `[..., N, D]` (float64) rotated at `pos` `[..., N]` with angles in float64 ("half" pairing)."""
    d = x.shape[-1]
    inv = 1.0 / BASE ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    ang = pos.double()[..., None] * inv
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    return x * cos + torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1) * sin


class Scene(NamedTuple):
    """A step over a paged cache and the raw (unrotated) tensors the reference reads."""

    batch: PagedBatch
    query: torch.Tensor  # [rows, Hq, D], rotated at stream indices, as vLLM hands it
    key_cache: torch.Tensor  # [slots, H, D], rotated at stream indices
    value_cache: torch.Tensor
    raw_q: torch.Tensor  # [tokens, Hq, D] float64
    raw_k: list  # per request [L, H, D] float64
    raw_v: list
    tokens: int


def scene(shape: Shape, seq_lens, query_lens, dtype, device, seed: int = 0, rows: int = 0,
          num_blocks: int = 0, width: int = 0) -> Scene:
    """Requests with streams `seq_lens` long after this step, whose last `query_lens` tokens are this
    step's queries. Blocks a request's step never reads (wholly between its sinks and the oldest window of
    its first query) are freed: their table entries point to the null block 0, which holds garbage. The
    cache has at least `num_blocks` blocks (3 spare ones by default), the table at least `width` columns."""
    s, bs = shape, shape.block_size
    g = torch.Generator().manual_seed(seed)
    need = []
    for L, t in zip(seq_lens, query_lens):
        first = L - t
        keep = [i for i in range(-(-L // bs)) if i * bs < s.sink or (i + 1) * bs - 1 >= first - s.window]
        need.append(keep)
    num_blocks = max(num_blocks, 1 + sum(len(k) for k in need) + 3)
    width = max(width, max(-(-L // bs) for L in seq_lens) + 1)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for r, keep in enumerate(need):
        for i in keep:
            table[r, i] = perm.pop()
    hq = s.kv_heads * s.group
    kc = torch.randn(num_blocks * bs, s.kv_heads, s.head_dim, generator=g, dtype=torch.float64)
    vc = torch.randn(num_blocks * bs, s.kv_heads, s.head_dim, generator=g, dtype=torch.float64)
    kc[:bs], vc[:bs] = 1e4, 1e4  # the null block: read, it would dominate every output
    raw_k, raw_v = [], []
    for r, L in enumerate(seq_lens):
        k = torch.randn(L, s.kv_heads, s.head_dim, generator=g, dtype=torch.float64)
        v = torch.randn(L, s.kv_heads, s.head_dim, generator=g, dtype=torch.float64)
        raw_k.append(k)
        raw_v.append(v)
        j = torch.arange(L)
        phys = table[r, j // bs].long() * bs + j % bs
        live = table[r, j // bs] > 0
        kc[phys[live]] = rotate64(k.transpose(0, 1), j.expand(s.kv_heads, L)).transpose(0, 1)[live]
        vc[phys[live]] = v[live]
    batch = paged_batch(table.to(device), seq_lens, query_lens, bs, num_blocks, rows=rows)
    tokens = sum(query_lens)
    raw_q = torch.randn(tokens, hq, s.head_dim, generator=g, dtype=torch.float64)
    pos = query_positions(batch).cpu()[:tokens]
    q = rotate64(raw_q.transpose(0, 1), pos.expand(hq, tokens)).transpose(0, 1)
    q = torch.cat((q, torch.zeros(batch.doc_ids.shape[0] - tokens, hq, s.head_dim, dtype=torch.float64)))
    return Scene(batch, q.to(device, dtype), kc.to(device, dtype), vc.to(device, dtype), raw_q, raw_k, raw_v, tokens)


def reference(sc: Scene, shape: Shape, positions: str) -> torch.Tensor:
    """`[tokens, Hq, D]` float64, from docs/vllm.md's sentence (see the module docstring)."""
    s = shape
    pos = query_positions(sc.batch).cpu()[:sc.tokens]
    doc = sc.batch.doc_ids.cpu()[:sc.tokens]
    scale = 1.0 / math.sqrt(s.head_dim)
    out = []
    for t in range(sc.tokens):
        p, r = int(pos[t]), int(doc[t])
        j = torch.tensor([i for i in range(p + 1) if i < s.sink or i >= p - s.window])
        e = max(0, p - s.sink - s.window) if positions == "cache" else 0
        kpos = torch.where(j < s.sink, j, j - e)
        k = rotate64(sc.raw_k[r][j].transpose(0, 1), kpos.expand(s.kv_heads, len(j)))  # [H, J, D]
        q = rotate64(sc.raw_q[t].view(s.kv_heads, s.group, s.head_dim),
                     torch.full((s.kv_heads, s.group), p - e))  # [H, G, D]
        w = torch.softmax(torch.einsum("hgd,hjd->hgj", q, k) * scale, -1)
        out.append(torch.einsum("hgj,jhd->hgd", w, sc.raw_v[r][j]).reshape(-1, s.head_dim))
    return torch.stack(out)


class Plan(NamedTuple):
    """What vLLM's metadata builder makes for a step before the model runs (outside the compiled forward and
    any CUDA graph): the retention's block mask and the physical-to-logical map its `score_mod` reads."""

    block_mask: object
    to_logical: torch.Tensor


def plan(batch: PagedBatch, sink: int, window: int, q_block: int, compute_q_blocks: bool) -> Plan:
    return Plan(retention_block_mask(batch, sink, window, q_block, compute_q_blocks=compute_q_blocks),
                physical_to_logical(batch))


def attend(query, key_cache, value_cache, batch: PagedBatch, step: Plan, cos_sin, *, sink: int, window: int,
           in_cache: bool, flex=flex_attention):
    """One layer as vLLM's FlexAttention backend runs it inside the compiled forward: in-cache sink scores
    when asked, then one FlexAttention call (`flex`) over the flattened cache under the step's block mask.
    `[rows, Hq, D]` out."""
    scale = 1.0 / math.sqrt(query.shape[-1])
    score_mod = None
    if in_cache and sink > 0:
        scores = sink_scores(query, key_cache, batch, sink, window, scale, cos_sin, True)
        score_mod = in_cache_score_mod(scores, sink,
                                       lambda q, kv: logical_kv_index(batch, step.to_logical, q, kv)[1])
    q, k, v = (x.transpose(0, 1)[None] for x in (query, key_cache, value_cache))
    if query.device.type == "cpu":  # inductor's CPU template reads only realized (not viewed) inputs
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    options = None
    if query.device.type == "cuda":  # vLLM's own for its direct-built block masks (`get_kernel_options`)
        options = dict(FORCE_USE_FLEX_ATTENTION=True, BLOCK_M=step.block_mask.BLOCK_SIZE[0],
                       BLOCK_N=step.block_mask.BLOCK_SIZE[1])
    out = flex(q, k, v, score_mod=score_mod, block_mask=step.block_mask, scale=scale, enable_gqa=True,
               kernel_options=options)
    return out[0].transpose(0, 1)


def _flex(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False, kernel_options=None):
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                          kernel_options=kernel_options)


def compiled_attend(device: torch.device, tag: str):
    """`attend` compiled whole with dynamic shapes on CUDA. On the CPU only its FlexAttention call is
    compiled: inductor's CPU template takes no tensor its `score_mod` or mask reads that the same graph
    computes (torch 2.13: a lowering error, or for a scattered map a wrong result), so the sink scores are
    computed eagerly beside it; and its C++ does not compile with dynamic shapes (an undeclared split-size
    variable), so the CPU compiles each step size once. Each `tag` has its own compiled cache."""
    if device.type == "cuda":
        return torch.compile(fresh_function(attend, tag), fullgraph=True, dynamic=True)
    return functools.partial(attend, flex=torch.compile(fresh_function(_flex, tag), fullgraph=True, dynamic=False))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref).norm() / ref.norm())


def layer(fn, sc: Scene, cos_sin, shape: Shape, *, in_cache: bool = True, sink: Optional[int] = None,
          window: Optional[int] = None):
    """Plan `sc`'s step (eagerly, as vLLM's metadata builder does) and run `fn` (`attend`, compiled) on it."""
    sink = shape.sink if sink is None else sink
    window = shape.window if window is None else window
    step = plan(sc.batch, sink, window, shape.q_block, compute_q_blocks=sc.query.device.type != "cuda")
    return fn(sc.query, sc.key_cache, sc.value_cache, sc.batch, step, cos_sin, sink=sink, window=window,
              in_cache=in_cache)


def _step_mixes(cuda: bool) -> list:
    """(name, seq_lens, query_lens): decoding requests past eviction, and a mix of prompt chunks across it."""
    if cuda:
        return [("decode x8 at 9k-20k", [9000 + 1500 * i for i in range(8)], [1] * 8),
                ("chunks 512+64 and decodes", [4700, 300, 6000, 5000], [512, 64, 1, 1])]
    return [("decode x3 past eviction", [70, 41, 200], [1, 1, 1]),
            ("chunks and decodes across eviction", [90, 30, 64, 150], [40, 8, 1, 1])]


def correctness(shape: Shape, device, report: dict, dtypes=(torch.bfloat16, torch.float32)) -> None:
    cuda = device.type == "cuda"
    for dtype in dtypes:
        fn = compiled_attend(device, f"paged_{dtype}".replace("torch.", ""))
        for name, seq_lens, qlens in _step_mixes(cuda):
            sc = scene(shape, seq_lens, qlens, dtype, device)
            table = rotary_table(max(seq_lens) + 1, shape.head_dim, device)
            for positions in ("cache", "stream"):
                out = layer(fn, sc, table, shape, in_cache=positions == "cache")
                err = relative_error(out[:sc.tokens], reference(sc, shape, positions))
                row = dict(name=name, dtype=str(dtype).replace("torch.", ""), positions=positions, error=err,
                           ok=bool(err <= TOL[dtype]))
                report.setdefault("correctness", []).append(row)
                print(f"  {name:36s} {row['dtype']:9s} {positions:6s} error {err:.2e} {'ok' if row['ok'] else 'FAIL'}")


def recompiles(shape: Shape, device, report: dict, steps=(1, 8, 64, 512)) -> None:
    """Steps of each size (that many decoding requests up to 8, else one request's prompt chunk), then a
    second step of 8 with other content (cache, block tables, queries). On CUDA (dynamic shapes) nothing compiles after the second size;
    on the CPU (static shapes, see `compiled_attend`) each size compiles once. Either way the repeat
    compiles nothing."""
    cuda = device.type == "cuda"
    fn = compiled_attend(device, "paged_steps")
    graphs = []
    for i, n in enumerate(tuple(steps) + (8,)):
        if n <= 8:  # the repeat: the same lengths (so the same cache size), other content and block tables
            seq_lens, qlens = [shape.window + 100 + 37 * r for r in range(n)], [1] * n
        else:
            seq_lens, qlens = [shape.window + 200 + n], [n]
        sc = scene(shape, seq_lens, qlens, torch.float32, device, seed=i)
        table = rotary_table(max(seq_lens) + 1, shape.head_dim, device)
        before = counters["stats"]["unique_graphs"]
        out = layer(fn, sc, table, shape)
        err = relative_error(out[:sc.tokens], reference(sc, shape, "cache"))
        graphs.append(dict(tokens=n, new_graphs=counters["stats"]["unique_graphs"] - before, error=err))
        print(f"  step of {n:4d} tokens: {graphs[-1]['new_graphs']} new graph(s)"
              + (f", error {err:.2e}" if err is not None else ""))
    late = sum(g["new_graphs"] for g in graphs[2:]) if cuda else max(g["new_graphs"] for g in graphs)
    ok = (late == 0 if cuda else late <= 1) and graphs[-1]["new_graphs"] == 0
    report["recompiles"] = dict(steps=graphs, ok=ok and all(
        g["error"] is None or g["error"] <= TOL[torch.float32] for g in graphs))


def cuda_graph(shape: Shape, device, report: dict) -> None:
    """Capture `fn` over 8 query rows (5 real, 3 padding) and replay it with other content (positions, block
    table, cache) copied into the same buffers, the step's plan made again outside the graph and copied
    into the captured plan's tensors, as vLLM's persistent metadata buffers are."""
    fn = compiled_attend(device, "paged_graph")
    rows, real = 8, [1, 1, 3]
    room = dict(rows=rows, num_blocks=3 * (shape.window // shape.block_size + 3) + 8, width=1024)
    first = scene(shape, [shape.window + 50, shape.window + 900, shape.window + 300], real, torch.bfloat16, device,
                  **room)
    table = rotary_table(16384, shape.head_dim, device)
    static = [t.clone() for t in (first.query, first.key_cache, first.value_cache)]
    sb = PagedBatch(*(x.clone() if torch.is_tensor(x) else x for x in first.batch))
    step = plan(sb, shape.sink, shape.window, shape.q_block, compute_q_blocks=False)
    kw = dict(sink=shape.sink, window=shape.window, in_cache=True)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*static, sb, step, table, **kw)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static, sb, step, table, **kw)
    rows_out = []
    for seed, lens in ((1, [shape.window + 2000, shape.window + 40, 9000]), (2, [5000, 12000, shape.window + 7])):
        sc = scene(shape, lens, real, torch.bfloat16, device, seed=seed, **room)
        if sc.key_cache.shape != static[1].shape or sc.batch.block_table.shape != sb.block_table.shape:
            raise RuntimeError("a replayed scene does not fit the captured buffers")
        for dst, src in zip(static, (sc.query, sc.key_cache, sc.value_cache)):
            dst.copy_(src)
        for name in ("block_table", "seq_lens", "query_start_loc", "doc_ids"):
            getattr(sb, name).copy_(getattr(sc.batch, name))
        fresh = plan(sb, shape.sink, shape.window, shape.q_block, compute_q_blocks=False)
        step.block_mask.kv_num_blocks.copy_(fresh.block_mask.kv_num_blocks)
        step.block_mask.kv_indices.copy_(fresh.block_mask.kv_indices)
        step.to_logical.copy_(fresh.to_logical)
        graph.replay()
        err = relative_error(out[:sc.tokens], reference(sc, shape, "cache"))
        rows_out.append(dict(seed=seed, error=err, ok=bool(err <= TOL[torch.bfloat16])))
        print(f"  replay {seed}: error {err:.2e} {'ok' if rows_out[-1]['ok'] else 'FAIL'}")
    report["cuda_graph"] = dict(rows=rows_out, ok=all(r["ok"] for r in rows_out))


def decode_timing(shape: Shape, device, report: dict, deadline: Optional[float] = None) -> None:
    """One decode step of `requests` streams at each position, one compiled layer (the plan made outside the
    timing, as vLLM makes it before the forward): flexkv's retention with in-cache positions against a plain
    sliding window of `sink + window + 1` keys (no sinks, no `score_mod`) over the same cache."""
    cuda = device.type == "cuda"
    fn = compiled_attend(device, "paged_decode")
    requests = 32 if cuda else 2
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for pos in ((4096, 32768, 131072) if cuda else (64, 512, 4096)):
        if deadline is not None and time.monotonic() > deadline:
            report.setdefault("skipped", []).append(f"paged decode timing at {pos}: past the deadline")
            break
        sc = scene(shape, [pos + 17 * r for r in range(requests)], [1] * requests, dtype, device, seed=pos)
        table = rotary_table(pos + 17 * requests + 1, shape.head_dim, device)
        cq = not cuda
        ours_plan = plan(sc.batch, shape.sink, shape.window, shape.q_block, cq)
        plain_plan = plan(sc.batch, 0, shape.sink + shape.window, shape.q_block, cq)
        args = (sc.query, sc.key_cache, sc.value_cache, sc.batch)
        ours = device_ms(lambda: fn(*args, ours_plan, table, sink=shape.sink, window=shape.window, in_cache=True),
                        device)
        plain = device_ms(lambda: fn(*args, plain_plan, table, sink=0, window=shape.sink + shape.window,
                                    in_cache=False), device)
        rows.append(dict(position=pos, requests=requests, flexkv_ms=ours, sliding_window_ms=plain,
                         ratio=ours / plain))
        print(f"  position {pos:7d} x {requests} requests: flexkv {ours:.3f} ms, sliding window {plain:.3f} ms "
              f"({ours / plain:.2f}x)")
    report["decode"] = rows


def run(device: torch.device, report: dict, deadline: Optional[float] = None) -> None:
    """Every check of the section into `report["paged"]`; a failing check is recorded and the rest go on."""
    cuda = device.type == "cuda"
    out = report.setdefault("paged", {})
    shape = shape_for(cuda)
    checks = [("correctness (compiled, against the dense reference)", correctness),
              ("recompiles over step sizes", recompiles)]
    if cuda:
        checks.append(("CUDA graph over padded rows", cuda_graph))
    checks.append(("decode against a plain sliding window", decode_timing))
    for title, check in checks:
        if deadline is not None and time.monotonic() > deadline:
            out.setdefault("skipped", []).append(title)
            continue
        print(f"paged ({title}):")
        try:
            with torch.no_grad():
                check(shape, device, out, deadline) if check is decode_timing else check(shape, device, out)
        except Exception as e:  # noqa: BLE001 - reported, and the section goes on
            out.setdefault("errors", []).append(f"{title}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            print(f"  ERROR {type(e).__name__}: {str(e).splitlines()[0][:300]}")


def failures(report: dict) -> list:
    p = report.get("paged", {})
    failed = [f"paged: {r['name']} {r['dtype']} {r['positions']}" for r in p.get("correctness", []) if not r["ok"]]
    if "recompiles" in p and not p["recompiles"]["ok"]:
        failed.append("paged: recompiles over step sizes")
    if "cuda_graph" in p and not p["cuda_graph"]["ok"]:
        failed.append("paged: CUDA graph replay")
    failed += [f"paged: {e}" for e in p.get("errors", [])]
    return failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="run the CPU version even when CUDA is available")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    torch.set_float32_matmul_precision("highest")
    report: dict = {}
    run(device, report)
    failed = failures(report)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2, default=str)
    print(f"paged section failures: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
