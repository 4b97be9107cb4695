"""A streaming chat decoder on flexkv: a small Llama-style model that never stops.

The model is Llama's architecture at toy width (RMSNorm, rotary embeddings,
grouped-query attention, SwiGLU) with random weights. Its attention keeps
StreamingLLM's 4 attention sinks plus a sliding window per request, in a
bounded flexkv cache:

- a long prompt is prefilled in chunks of `chunk` tokens with a per-query
  window and sink (`query_window = window`, docs/contract.md section 2): every prompt
  token attends exactly what it would if the prompt were fed one token at a
  time, StreamingLLM-style, however far past the window the prompt goes;
- then it decodes one token per step, far past the window;
- requests join and leave through a `flexkv.StreamSession`, which keeps
  their positions and lanes and pads every step to a fixed batch: a step
  where some request is still prefilling carries `chunk` tokens per row
  (a decoding request feeds one; the per-query window keeps it from seeing
  the padding after it), otherwise one.

`rope_positions="stream"` rotates every key once, at its stream index;
`"cache"` uses StreamingLLM's in-cache positions (served by
`flexkv.cache.positions.rotary.SinkRotation`: only the sink keys are re-rotated, O(sink) per
step). In ``"cache"`` mode the prompt goes in one token per step, as
StreamingLLM feeds it: a chunk past the window would need a different
rotation of the sinks for each of its queries.

The same model class runs without a bounded cache (`flexkv.model.uncached`:
every key kept, attention recomputed over the whole history with the
retention mask); `python examples/streaming_chat.py` streams both and
prints tokens/s, the cache's memory and the largest logit deviation.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from flexkv import BoundedKVConfig, BoundedKVManager, Rotary, SinkWindow, StepContext, StreamSession, UncachedHistory
from flexkv.model.wrap import attention


@dataclass(frozen=True)
class ChatConfig:
    """Model width and cache policy of the chat decoder."""

    vocab: int = 256
    dim: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 160
    rope_base: float = 10000.0
    sink: int = 4
    window: int = 60
    chunk: int = 16
    max_requests: int = 4
    rope_positions: str = "stream"

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def cache_config(self) -> BoundedKVConfig:
        """One row per request, no source, a per-query window for chunked prefill."""
        return BoundedKVConfig(
            num_layers=self.layers,
            num_heads=self.kv_heads,
            head_dim=self.head_dim,
            rows_per_request=1,
            max_source_len=0,
            retention=SinkWindow(self.sink, self.window),
            max_slots=self.max_requests,
            query_window=self.window,
            max_step_tokens=self.chunk,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Grouped-query self-attention; `core` is the `(q, k, v) -> out` that holds the cache."""

    def __init__(self, cfg: ChatConfig, core: nn.Module):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.heads * hd, cfg.dim, bias=False)
        self.core = core

    def forward(self, x):  # x [N, T, dim]
        N, T, _ = x.shape
        hd = self.cfg.head_dim
        q = self.wq(x).view(N, T, -1, hd).transpose(1, 2)
        k = self.wk(x).view(N, T, -1, hd).transpose(1, 2)
        v = self.wv(x).view(N, T, -1, hd).transpose(1, 2)
        out = self.core(q, k, v)  # [N, heads, T, hd]
        return self.wo(out.transpose(1, 2).reshape(N, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ChatConfig, core: nn.Module):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg, core)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.mlp = SwiGLU(cfg.dim, cfg.ffn)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class ChatDecoder(nn.Module):
    """`tokens [N, T]` -> logits `[N, T, vocab]`; attention state lives in `context`'s cache."""

    def __init__(self, cfg: ChatConfig, context: StepContext):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        rotary = Rotary(cfg.head_dim, cfg.rope_base)
        self.blocks = nn.ModuleList(
            Block(cfg, attention(context, i, rotary=rotary, rope_positions=cfg.rope_positions))
            for i in range(cfg.layers)
        )
        self.norm = RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


class Runner:
    """The model on a `StreamSession` over one cache (bounded or uncached), compiled or not."""

    def __init__(self, cfg: ChatConfig, cache, compile: bool = False, weights: Optional[dict] = None):
        # a prefill chunk of `chunk` tokens or a decode step of 1; StreamingLLM's cache positions feed one
        token_sizes = (1, cfg.chunk) if cfg.rope_positions == "stream" else (1,)
        self.session = StreamSession(cache, compile=compile, token_sizes=token_sizes)
        self.model = ChatDecoder(cfg, self.session.context).eval().requires_grad_(False)  # inference only: compiled CPU FlexAttention has no backward
        if weights is not None:
            self.model.load_state_dict(weights)

    def forward(self, attn, tokens):
        """The session's model step: `tokens [B, T]` -> logits `[B, T, vocab]` (attention through `attn`)."""
        return self.model(tokens)

    @classmethod
    def bounded(cls, cfg: ChatConfig, compile: bool = False, weights=None,
                block_size: Optional[int] = None) -> "Runner":
        return cls(cfg, BoundedKVManager(cfg.cache_config(), block_size=block_size), compile, weights)

    @classmethod
    def uncached(cls, cfg: ChatConfig, weights=None) -> "Runner":
        return cls(cfg, UncachedHistory(cfg.cache_config()), False, weights)


@dataclass
class Request:
    rid: str
    prompt: List[int]
    max_new: int
    start_step: int = 0
    fed: int = 0  # prompt tokens written
    generated: List[int] = field(default_factory=list)
    written: int = 0

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)


@torch.no_grad()
def stream(cfg: ChatConfig, runners: List[Runner], requests: List[Request],
           on_step: Optional[Callable] = None) -> dict:
    """Stream `requests` through every runner in lockstep (the first one picks the tokens).

    Each request joins at its `start_step` and leaves once it has generated
    `max_new` tokens; a prefilling request feeds its next `chunk` prompt
    tokens (one at a time with cache positions), a decoding one its last
    generated token. Returns `steps`, `tokens` (written), `seconds` (per
    runner, host planning included), `max_dev` (largest |logit| difference
    of each runner from the last one over every position every request
    wrote) and `max_len` (the longest stream).
    """
    chunk = cfg.chunk if cfg.rope_positions == "stream" else 1
    seconds = [0.0] * len(runners)
    max_dev = [0.0] * len(runners)
    steps = tokens_written = 0
    done = set()
    while len(done) < len(requests):
        feeds = {}
        for r in requests:
            if r.start_step > steps or r.rid in done:
                continue
            if r.prefilling:
                feeds[r.rid] = torch.tensor(r.prompt[r.fed:r.fed + chunk])
            else:
                feeds[r.rid] = torch.tensor(r.generated[-1:])
        outs = []
        for k, run in enumerate(runners):
            t0 = time.perf_counter()
            outs.append(run.session.step(feeds, run.forward))
            seconds[k] += time.perf_counter() - t0
        for r in requests:
            if r.rid not in feeds:
                continue
            for k in range(len(runners)):
                max_dev[k] = max(max_dev[k], (outs[k][r.rid] - outs[-1][r.rid]).abs().max().item())
            span = len(feeds[r.rid])
            r.written += span
            tokens_written += span
            if r.prefilling:
                r.fed += span
                if r.prefilling:
                    continue
            r.generated.append(int(outs[0][r.rid][-1].argmax()))
            if len(r.generated) >= r.max_new:
                done.add(r.rid)
                for run in runners:
                    run.session.finish(r.rid)
        steps += 1
        if on_step is not None:
            on_step(steps, outs)
    return {"steps": steps, "tokens": tokens_written, "seconds": seconds, "max_dev": max_dev,
            "max_len": max(r.written for r in requests)}


def make_requests(prompt_lens, max_new, start_steps=None, seed: int = 0, vocab: int = 256) -> List[Request]:
    g = torch.Generator().manual_seed(seed)
    starts = start_steps or [0] * len(prompt_lens)
    return [
        Request(f"chat{i}", torch.randint(0, vocab, (n,), generator=g).tolist(), max_new, start_step=s)
        for i, (n, s) in enumerate(zip(prompt_lens, starts))
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rope-positions", choices=("stream", "cache"), default="stream")
    ap.add_argument("--new-tokens", type=int, default=300, help="tokens each request generates")
    ap.add_argument("--eager", action="store_true", help="do not torch.compile the bounded model")
    ap.add_argument("--no-check", action="store_true", help="skip the uncached twin (no deviation figure)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's choice); fewer than the free cores avoids stalls")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ChatConfig(rope_positions=args.rope_positions)
    bounded = Runner.bounded(cfg, compile=not args.eager)
    runners = [bounded]
    if not args.no_check:
        runners.append(Runner.uncached(cfg, weights=bounded.model.state_dict()))
    # four requests, prompts of 1.5-4x the window, two of them joining late
    reqs = make_requests([240, 90, 150, 200], args.new_tokens, start_steps=[0, 0, 12, 40], vocab=cfg.vocab)
    # compile both step shapes (a prefill chunk, a decode step) on padding, outside the timing
    bounded.session.warmup(bounded.forward, torch.zeros(1, dtype=torch.long))
    res = stream(cfg, runners, reqs)
    m = bounded.session.cache
    sink_copies = sum(b.attn.core.rope.memory_bytes for b in bounded.model.blocks)
    print(f"streaming chat decoder: {cfg.layers} layers, {cfg.heads} q / {cfg.kv_heads} kv heads x {cfg.head_dim}, "
          f"sink {cfg.sink} + window {cfg.window}, prefill chunk {cfg.chunk}, rope positions {cfg.rope_positions!r}, "
          f"{'eager' if args.eager else 'compiled'}, "
          f"{torch.get_num_threads()} threads")
    print(f"  {len(reqs)} requests, {res['steps']} steps, {res['tokens']} tokens written, longest stream {res['max_len']}")
    print(f"  bounded: {res['tokens'] / res['seconds'][0]:.0f} tokens/s ({1e3 * res['seconds'][0] / res['steps']:.2f} ms/step)")
    print(f"  memory held: {m.memory_bytes / 2**10:.1f} KiB KV cache ({m.slot_bytes / 2**10:.1f} KiB per request)"
          + (f" + {sink_copies / 2**10:.1f} KiB un-rotated sink keys" if sink_copies else ""))
    if not args.no_check:
        print(f"  largest |logit| deviation from the uncached model: {res['max_dev'][0]:.2e}")
    return res


if __name__ == "__main__":
    main()
