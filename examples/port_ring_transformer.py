"""Porting a streaming transformer that has its own ring KV cache to flexkv.

`examples/ring_transformer.py` is a model written without flexkv: a ring of
`context` keys per layer, rotary positions on interleaved pairs, chunked
streaming. This script puts flexkv under it with `flexkv.swap_attention`,
keeping the model's modules, projections, RoPE and weights, and checks the
port output by output:

- against the model's own streaming (its ring caches), for chunks of
  `--chunk` frames and then single frames, eager and compiled;
- against the uncached twin (`flexkv.model.uncached.UncachedHistory`: every key
  kept, attention over the whole history with the retention mask, float64);
- the literal mapping of the model's `context` (`SinkWindow(0, context)`,
  non-causal chunks) is run too, to show what it gets wrong.

The mapping of the model's conventions (docs/models.md, "Conventions"):

==============================================  ==========================================
the model says                                  flexkv
==============================================  ==========================================
`context=C`: C keys, the query included          `retention=SinkWindow.keys(C)`
a chunk's frames see the ring, causally          `causal_step=True`
rotary on interleaved pairs, at time step `p`    its own `apply_rope` at
                                                 `attn.stream_positions()`, or
                                                 `Rotary(D, layout="interleaved")`
its ring caches (streaming mode)                 the session's cache: the model stays
                                                 offline, its attention swapped
==============================================  ==========================================

Then it times both, same process, round-robin: ms per step of single frames
and of chunks, eager and compiled, and the memory each cache holds.

    PYTHONPATH=. python examples/port_ring_transformer.py [--streams 4 --layers 4 --chunk 8 --threads 1]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Dict, List

import torch

from flexkv import BoundedKVConfig, Rotary, SinkWindow, StreamSession, UncachedHistory, swap_attention

try:
    from examples.ring_transformer import StreamingAttention, StreamingTransformer, TransformerArgs, apply_rope
except ImportError:  # run as a script from examples/
    from ring_transformer import StreamingAttention, StreamingTransformer, TransformerArgs, apply_rope


def cache_config(args: TransformerArgs, streams: int, chunk: int, literal: bool = False) -> BoundedKVConfig:
    """The model's attention in flexkv's terms. `literal=True` is the tempting, wrong reading of
    `context` (`window = context`, chunks attended whole)."""
    return BoundedKVConfig(
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        head_dim=args.d_model // args.num_heads,
        rows_per_request=1,
        max_source_len=0,
        max_sources=0,
        retention=SinkWindow(0, args.context) if literal else SinkWindow.keys(args.context),
        causal_step=not literal,
        max_slots=streams,
        max_step_tokens=chunk,
    )


def attention_with_model_rope(self: StreamingAttention, attn, x: torch.Tensor) -> torch.Tensor:
    """The model's attention forward with flexkv's core: its projections, its own RoPE at the
    stream positions flexkv gives, its output projection."""
    B, T, _ = x.shape
    q, k, v = self.in_proj(x).view(B, T, 3, self.num_heads, self.head_dim).unbind(2)
    q, k = apply_rope(q, k, attn.stream_positions(), self.max_period)
    out = attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return self.out_proj(out.transpose(1, 2).reshape(B, T, -1))


def attention_with_flexkv_rope(self: StreamingAttention, attn, x: torch.Tensor) -> torch.Tensor:
    """The same with flexkv rotating `q`, `k` (the core was given `Rotary(..., layout="interleaved")`)."""
    B, T, _ = x.shape
    q, k, v = self.in_proj(x).view(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
    out = attn(q, k, v)
    return self.out_proj(out.transpose(1, 2).reshape(B, T, -1))


class Port:
    """A copy of `model` whose attention runs on a flexkv cache, driven by a `StreamSession`."""

    def __init__(self, model: StreamingTransformer, streams: int, chunk: int, *, uncached: bool = False,
                 compile: bool = False, rope: str = "model", literal: bool = False):
        self.model = copy.deepcopy(model)
        a = model.args
        cfg = cache_config(a, streams, chunk, literal)
        self.session = StreamSession(UncachedHistory(cfg) if uncached else cfg, compile=compile,
                                     token_sizes=(1, chunk))
        if rope == "model":
            self.swap = swap_attention(self.model, self.session.context, StreamingAttention, attention_with_model_rope)
        else:
            rotary = Rotary(a.d_model // a.num_heads, a.max_period, layout="interleaved", angle_dtype=torch.float32)
            self.swap = swap_attention(self.model, self.session.context, StreamingAttention,
                                       attention_with_flexkv_rope, rotary=rotary)

        model = self.model
        self._forward = lambda attn, x: model(x)  # one function object: the session compiles per function

    def step(self, frames: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """`frames[rid]`: `[T, d_in]` -> each stream's output `[T, d_out]`."""
        res = self.session.step(frames, self._forward)
        return {rid: res[rid] for rid in frames}

    def memory_bytes(self) -> int:
        return self.session.cache.memory_bytes


class OwnStreaming:
    """The model's own streaming mode (its ring caches), eager or compiled, for `streams` streams in lockstep."""

    def __init__(self, model: StreamingTransformer, streams: int, *, compile: bool = False):
        self.model = copy.deepcopy(model)
        self._mode = self.model.streaming(streams)
        self._mode.__enter__()
        self.forward = torch.compile(self.model, fullgraph=True, dynamic=False) if compile else self.model

    def step(self, frames: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        y = self.forward(torch.stack(list(frames.values())))
        return {rid: y[i] for i, rid in enumerate(frames)}

    def memory_bytes(self) -> int:
        return self.model.cache_bytes()


def schedule(args: TransformerArgs, streams: int, chunk: int, chunks: int, frames: int, seed: int = 0) -> List[dict]:
    """`chunks` steps of `chunk` frames, then `frames` steps of one frame, for every stream."""
    g = torch.Generator().manual_seed(seed)
    steps = [chunk] * chunks + [1] * frames
    return [{f"s{i}": torch.randn(T, args.d_in, generator=g) for i in range(streams)} for T in steps]


def stream_all(runner, steps: List[dict]) -> List[dict]:
    with torch.no_grad():
        return [runner.step(feeds) for feeds in steps]


def max_deviation(a: List[dict], b: List[dict]) -> float:
    return max((x[rid].double() - y[rid].double()).abs().max().item() for x, y in zip(a, b) for rid in x)


def time_round_robin(runners: Dict[str, object], feeds: Dict[int, dict], steps: int, rounds: int = 5) -> dict:
    """Median ms per step of each runner, for each step length in `feeds` (T -> one step's feeds):
    `rounds` rounds of `steps // rounds` steps each, variants in turn, so other load falls on all alike."""
    times = {(name, T): [] for name in runners for T in feeds}
    with torch.no_grad():
        for name, r in runners.items():  # warm: compiled graphs, caches past their first steps
            for f in feeds.values():
                r.step(f)
        for _ in range(rounds):
            for T, f in feeds.items():
                for name, r in runners.items():
                    for _ in range(max(1, steps // rounds)):
                        t0 = time.perf_counter()
                        r.step(f)
                        times[(name, T)].append(1e3 * (time.perf_counter() - t0))
    return {key: statistics.median(t) for key, t in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=250)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=80, help="chunks per stream in the check, then --frames single frames")
    ap.add_argument("--frames", type=int, default=40)
    ap.add_argument("--steps", type=int, default=100, help="timed steps per variant and step length")
    ap.add_argument("--threads", type=int, default=None)
    opts = ap.parse_args(argv)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    args = TransformerArgs(d_in=32, d_model=opts.d_model, num_heads=opts.heads, num_layers=opts.layers,
                           dim_feedforward=2 * opts.d_model, context=opts.context, d_out=32)
    model = StreamingTransformer(args).eval().requires_grad_(False)
    S, T = opts.streams, opts.chunk
    steps = schedule(args, S, T, opts.chunks, opts.frames)
    print(f"model: {args.num_layers} layers, d_model {args.d_model}, {args.num_heads} heads, context {args.context} "
          f"keys (the query included); {S} streams, {opts.chunks} chunks of {T} frames "
          f"({opts.chunks * T} frames, {opts.chunks * T / args.context:.1f}x the context), then {opts.frames} single "
          f"frames; fp32, {torch.get_num_threads()} threads")

    t0 = time.perf_counter()
    variants = {
        "own, eager": OwnStreaming(model, S),
        "flexkv, eager": Port(model, S, T),
        "flexkv, flexkv RoPE": Port(model, S, T, rope="flexkv"),
        "uncached twin": Port(model, S, T, uncached=True),
        "literal context (wrong)": Port(model, S, T, literal=True),
        "own, compiled": OwnStreaming(model, S, compile=True),
        "flexkv, compiled": Port(model, S, T, compile=True),
    }
    outs = {name: stream_all(r, steps) for name, r in variants.items()}
    print(f"streamed every variant in {time.perf_counter() - t0:.1f} s (compiles included)")
    own, twin = outs["own, eager"], outs["uncached twin"]
    C = opts.chunks
    print(f"largest deviation         vs own streaming (eager): T={T}    T=1    vs uncached twin")
    for name, out in outs.items():
        if name in ("own, eager",):
            continue
        print(f"  {name:<24} {max_deviation(out[:C], own[:C]):>28.2e} {max_deviation(out[C:], own[C:]):>8.2e} "
              f"{max_deviation(out, twin):>14.2e}")

    timed = {name: variants[name] for name in ("own, eager", "flexkv, eager", "own, compiled", "flexkv, compiled")}
    g = torch.Generator().manual_seed(1)
    feeds = {t: {f"s{i}": torch.randn(t, args.d_in, generator=g) for i in range(S)} for t in (1, T)}
    ms = time_round_robin(timed, feeds, opts.steps)
    print(f"ms per step (median, round-robin)   T=1      T={T}    KV memory")
    for name, r in timed.items():
        print(f"  {name:<30} {ms[(name, 1)]:>7.2f} {ms[(name, T)]:>8.2f}   {r.memory_bytes() / 2 ** 10:>7.0f} KiB")
    return outs, ms


if __name__ == "__main__":
    main()
