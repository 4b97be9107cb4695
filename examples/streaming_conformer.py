"""A cache-aware streaming conformer encoder on flexkv.

Conformer blocks (macaron feed-forwards, self-attention, a convolution
module; random weights, small width) encode a stream of feature frames -
already subsampled - chunk by chunk, as cache-aware streaming ASR encoders
do:

- self-attention keeps a left context of `window = 70` frames per request
  (`SinkWindow(0, 70)`) in a bounded flexkv cache;
- its position information is Transformer-XL's relative encoding. The terms
  that depend on positions only - the global position bias `v . W_r R(i-j)`
  per head, a table over the relative distance - are a FlexAttention
  `score_mod`, applied on in-cache positions (`positions="cache"`: a key's
  place in the cache, as a fixed-size attention cache numbers them); the
  global content bias `u` is added to the queries. (The per-query term
  `q . W_r R(i-j)` is left out: a `score_mod` cannot see the query vector.)
- the convolution module's depthwise convolution is causal; its last
  `kernel - 1` inputs per layer are carried from step to step with the
  request (the `StreamSession` keeps it as the request's state).

Two variants (`ConformerConfig.causal`):

- chunked (default): a step carries `chunk` frames plus `lookahead` frames of
  right context; every frame of the step attends the retained window and
  all of the step's frames; only the chunk is written (`span = chunk`), the
  look-ahead frames come again as the start of the next chunk;
- causal: a per-query window (`query_window = window`): each frame attends
  the `window` frames before it and itself, nothing later, however the
  stream is cut into chunks.

The same model runs without a bounded cache (`flexkv.model.uncached`) for
checking; `python examples/streaming_conformer.py` streams both and prints
frames per second, the cache's memory and the largest deviation.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from flexkv import BoundedKVConfig, BoundedKVManager, Chunk, SinkWindow, StepContext, StreamSession, UncachedHistory
from flexkv.model.wrap import attention


@dataclass(frozen=True)
class ConformerConfig:
    """Model width, chunking and cache policy of the streaming conformer."""

    feats: int = 32
    dim: int = 64
    heads: int = 4
    layers: int = 2
    ffn: int = 128
    kernel: int = 7
    chunk: int = 10
    lookahead: int = 4
    window: int = 70
    max_rel: int = 96  # relative distances are clipped to [-max_rel, max_rel]
    causal: bool = False
    max_requests: int = 4

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def step_tokens(self) -> int:
        return self.chunk if self.causal else self.chunk + self.lookahead

    def cache_config(self) -> BoundedKVConfig:
        return BoundedKVConfig(
            num_layers=self.layers,
            num_heads=self.heads,
            head_dim=self.head_dim,
            rows_per_request=1,
            max_source_len=0,
            retention=SinkWindow(0, self.window),
            max_slots=self.max_requests,
            query_window=self.window if self.causal else None,
            max_step_tokens=self.step_tokens,
        )


def sinusoids(n: int, dim: int) -> torch.Tensor:
    """Transformer-XL's relative position encodings `R` for distances `-n .. n`: `[2n + 1, dim]`."""
    d = torch.arange(-n, n + 1, dtype=torch.float64).unsqueeze(1)
    inv = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return torch.cat([(d * inv).sin(), (d * inv).cos()], dim=1).float()


class RelPositionAttention(nn.Module):
    """Multi-head self-attention with Transformer-XL's position-only terms; `core` holds the cache."""

    def __init__(self, cfg: ConformerConfig, core_factory):
        super().__init__()
        self.cfg = cfg
        H, hd = cfg.heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.dim)
        self.pos_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)  # W_r
        self.pos_bias_u = nn.Parameter(torch.randn(H, hd) * 0.2)  # global content bias
        self.pos_bias_v = nn.Parameter(torch.randn(H, hd) * 0.2)  # global position bias
        # the score_mod's table: read inside the attention kernel, so a buffer (a graph input),
        # refreshed from the weights by `refresh_position_table`, never computed in the step
        self.register_buffer("rel_table", torch.zeros(H, 2 * cfg.max_rel + 1))
        self.refresh_position_table()
        table, M = self.rel_table, cfg.max_rel

        def rel_bias(score, b, h, q_pos, kv_pos):
            return score + table[h, (q_pos - kv_pos).clamp(-M, M) + M]

        self.core = core_factory(score_mod=rel_bias, positions="cache")

    @torch.no_grad()
    def refresh_position_table(self) -> None:
        """`rel_table[h, d + max_rel] = v_h . (W_r R(d))_h / sqrt(head_dim)` for every clipped distance `d`.

        Call it again after changing `pos_proj` or `pos_bias_v` (the table is saved with the weights).
        """
        cfg = self.cfg
        R = sinusoids(cfg.max_rel, cfg.dim).to(self.pos_proj.weight)
        r = self.pos_proj(R).view(-1, cfg.heads, cfg.head_dim)  # [2M + 1, H, hd]
        self.rel_table.copy_(torch.einsum("hd,mhd->hm", self.pos_bias_v, r) / math.sqrt(cfg.head_dim))

    def forward(self, x):  # [N, T, dim]
        N, T, _ = x.shape
        q, k, v = self.qkv(x).view(N, T, 3, self.cfg.heads, self.cfg.head_dim).permute(2, 0, 3, 1, 4)
        q = q + self.pos_bias_u.view(1, self.cfg.heads, 1, self.cfg.head_dim)
        return self.out(self.core(q, k, v).transpose(1, 2).reshape(N, T, -1))


class ConvModule(nn.Module):
    """Pointwise conv + GLU, causal depthwise conv (state carried between steps), LayerNorm, SiLU, pointwise."""

    def __init__(self, cfg: ConformerConfig):
        super().__init__()
        self.cfg = cfg
        self.pw1 = nn.Linear(cfg.dim, 2 * cfg.dim)
        self.dw = nn.Conv1d(cfg.dim, cfg.dim, cfg.kernel, groups=cfg.dim)
        self.norm = nn.LayerNorm(cfg.dim)
        self.pw2 = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x, state, span):
        """`x [N, T, dim]`, `state [N, dim, kernel - 1]` (the inputs before `x`), `span` frames written.

        Returns the output and the next state: the last `kernel - 1` inputs up to frame `span`.
        """
        h = F.glu(self.pw1(x), dim=-1).transpose(1, 2)  # [N, dim, T]
        full = torch.cat([state, h], dim=2)
        new_state = full[:, :, span:span + self.cfg.kernel - 1]
        h = self.dw(full).transpose(1, 2)
        return self.pw2(F.silu(self.norm(h))), new_state


class FeedForward(nn.Module):
    def __init__(self, cfg: ConformerConfig):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(cfg.dim), nn.Linear(cfg.dim, cfg.ffn), nn.SiLU(),
                                 nn.Linear(cfg.ffn, cfg.dim))

    def forward(self, x):
        return self.net(x)


class ConformerBlock(nn.Module):
    """Macaron conformer block. Its self-attention is `RelPositionAttention` on `core_factory`'s core, or
    any `attention` module `x [N, T, dim] -> [N, T, dim]` given instead."""

    def __init__(self, cfg: ConformerConfig, core_factory=None, attention: Optional[nn.Module] = None):
        super().__init__()
        self.ff1 = FeedForward(cfg)
        self.attn_norm = nn.LayerNorm(cfg.dim)
        self.attn = attention if attention is not None else RelPositionAttention(cfg, core_factory)
        self.conv_norm = nn.LayerNorm(cfg.dim)
        self.conv = ConvModule(cfg)
        self.ff2 = FeedForward(cfg)
        self.out_norm = nn.LayerNorm(cfg.dim)

    def forward(self, x, state, span):
        x = x + 0.5 * self.ff1(x)
        x = x + self.attn(self.attn_norm(x))
        c, state = self.conv(self.conv_norm(x), state, span)
        x = x + c
        x = x + 0.5 * self.ff2(x)
        return self.out_norm(x), state


class StreamingConformer(nn.Module):
    """`feats [N, T, feats]`, conv state `[N, layers, dim, kernel - 1]` -> `[N, T, dim]` and the next state."""

    def __init__(self, cfg: ConformerConfig, context: StepContext):
        super().__init__()
        self.cfg = cfg
        self.in_proj = nn.Linear(cfg.feats, cfg.dim)
        self.blocks = nn.ModuleList(
            ConformerBlock(cfg, lambda **kw: attention(context, i, **kw)) for i in range(cfg.layers)
        )

    def forward(self, feats, state):
        x = self.in_proj(feats)
        span = self.cfg.chunk
        states = []
        for i, block in enumerate(self.blocks):
            x, s = block(x, state[:, i], span)
            states.append(s)
        return x, torch.stack(states, dim=1)


class Runner:
    """A conformer on a `StreamSession` over one cache (bounded or uncached), compiled or not.

    The session carries each request's convolution state (`initial_state`):
    it hands the model every lane's state and keeps what the model returns.
    """

    def __init__(self, cfg: ConformerConfig, cache, compile: bool = False, weights: Optional[dict] = None):
        self.cfg = cfg
        self.session = StreamSession(cache, compile=compile, token_sizes=(cfg.step_tokens,),
                                     initial_state=lambda: torch.zeros(cfg.layers, cfg.dim, cfg.kernel - 1))
        self.model = StreamingConformer(cfg, self.session.context).eval().requires_grad_(False)  # inference only: compiled CPU FlexAttention has no backward
        if weights is not None:
            self.model.load_state_dict(weights)

    def forward(self, attn, feats, state):
        """The session's model step: `feats [B, T, feats]`, conv state `[B, layers, dim, kernel - 1]`."""
        return self.model(feats, state)

    @classmethod
    def bounded(cls, cfg: ConformerConfig, compile: bool = False, weights=None,
                block_size: Optional[int] = None) -> "Runner":
        return cls(cfg, BoundedKVManager(cfg.cache_config(), block_size=block_size), compile, weights)

    @classmethod
    def uncached(cls, cfg: ConformerConfig, weights=None) -> "Runner":
        return cls(cfg, UncachedHistory(cfg.cache_config()), False, weights)


@dataclass
class Utterance:
    rid: str
    feats: torch.Tensor  # [frames, feats], frames a multiple of the chunk
    start_step: int = 0
    done: int = 0  # frames encoded and written

    @property
    def finished(self) -> bool:
        return self.done >= self.feats.shape[0]


@torch.no_grad()
def stream(cfg: ConformerConfig, runners: List, utterances: List[Utterance]) -> dict:
    """Encode `utterances` on every runner in lockstep, one chunk per request per step.

    Returns `steps`, `frames`, `seconds` per runner, `max_dev` (largest
    output difference of each runner from the last over every encoded frame)
    and `outputs` (the first runner's encoder output per request).
    """
    C, T = cfg.chunk, cfg.step_tokens
    seconds = [0.0] * len(runners)
    max_dev = [0.0] * len(runners)
    outputs = {u.rid: [] for u in utterances}
    steps = frames = 0
    while not all(u.finished for u in utterances):
        feeds = {}
        for u in utterances:
            if u.start_step > steps or u.finished:
                continue
            chunk = torch.zeros(T, cfg.feats)
            got = u.feats[u.done:u.done + T]  # the chunk and its look-ahead (zeros past the end)
            chunk[:got.shape[0]] = got
            feeds[u.rid] = Chunk(chunk, span=C)  # the look-ahead frames are read, not written
        outs = []
        for k, run in enumerate(runners):
            t0 = time.perf_counter()
            outs.append(run.session.step(feeds, run.forward))
            seconds[k] += time.perf_counter() - t0
        for u in utterances:
            if u.rid not in feeds:
                continue
            for k in range(len(runners)):
                max_dev[k] = max(max_dev[k], (outs[k][u.rid][:C] - outs[-1][u.rid][:C]).abs().max().item())
            outputs[u.rid].append(outs[0][u.rid][:C])
            u.done += C
            frames += C
            if u.finished:
                for run in runners:
                    run.session.finish(u.rid)
        steps += 1
    return {"steps": steps, "frames": frames, "seconds": seconds, "max_dev": max_dev,
            "outputs": {rid: torch.cat(o) for rid, o in outputs.items()}}


def make_utterances(cfg: ConformerConfig, chunks, start_steps=None, seed: int = 0) -> List[Utterance]:
    g = torch.Generator().manual_seed(seed)
    starts = start_steps or [0] * len(chunks)
    return [Utterance(f"utt{i}", torch.randn(c * cfg.chunk, cfg.feats, generator=g), start_step=s)
            for i, (c, s) in enumerate(zip(chunks, starts))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--causal", action="store_true", help="per-query window instead of chunks with look-ahead")
    ap.add_argument("--chunks", type=int, default=300, help="chunks each utterance streams")
    ap.add_argument("--eager", action="store_true", help="do not torch.compile the bounded model")
    ap.add_argument("--no-check", action="store_true", help="skip the uncached twin (no deviation figure)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's choice); fewer than the free cores avoids stalls")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ConformerConfig(causal=args.causal)
    bounded = Runner.bounded(cfg, compile=not args.eager)
    runners = [bounded]
    if not args.no_check:
        runners.append(Runner.uncached(cfg, weights=bounded.model.state_dict()))
    n = args.chunks
    utts = make_utterances(cfg, [n, max(1, n - 20), n, max(1, n // 2)], start_steps=[0, 0, 7, n // 4])
    # compile outside the timing, on padding steps of the same shape
    bounded.session.warmup(bounded.forward, torch.zeros(cfg.step_tokens, cfg.feats))
    res = stream(cfg, runners, utts)
    m = bounded.session.cache
    mode = (f"causal, per-query window {cfg.window}" if cfg.causal
            else f"chunk {cfg.chunk} + look-ahead {cfg.lookahead}, window {cfg.window}")
    print(f"cache-aware streaming conformer: {cfg.layers} layers, {cfg.heads} heads x {cfg.head_dim}, {mode}, "
          f"Transformer-XL bias on in-cache positions, {'eager' if args.eager else 'compiled'}, "
          f"{torch.get_num_threads()} threads")
    print(f"  {len(utts)} utterances, {res['steps']} steps, {res['frames']} frames encoded")
    print(f"  bounded: {res['frames'] / res['seconds'][0]:.0f} frames/s ({1e3 * res['seconds'][0] / res['steps']:.2f} "
          f"ms/step)")
    print(f"  memory held: {m.memory_bytes / 2**10:.1f} KiB KV cache ({m.slot_bytes / 2**10:.1f} KiB per request)")
    if not args.no_check:
        print(f"  largest |output| deviation from the uncached model: {res['max_dev'][0]:.2e}")
    return res


if __name__ == "__main__":
    main()
