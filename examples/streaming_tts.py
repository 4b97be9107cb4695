"""Streaming text-to-speech on flexkv: a flow-matching DiT that speaks chunk by chunk.

The acoustic model is a small diffusion transformer (adaLN-zero blocks,
random weights) trained - in spirit - with flow matching: a chunk of
`chunk` mel frames starts as noise and `solver_steps` Euler steps move it
along the model's velocity field, conditioned per frame on speech tokens.
Streaming works as in chunk-aware flow-matching decoders, whose attention
cache (one per solver step and block) follows the pipeline's own rule,
written as such pipelines write it (`PipelineCacheAttention` below):

    kv = torch.cat([kv_chunk, cache], dim=time)          # the new chunk goes in front
    out = attention(q_chunk, kv)
    cache = kv if len(kv) <= L + sink else torch.cat([kv[:L], kv[-sink:]])

The cache starts as the voice prompt's keys (`L` frames, a speaker's
reference mel encoded once); it keeps its newest `L` frames and its oldest
`sink` (100): the prompt's last frames. In flexkv's terms
(docs/models.md, "Conventions"): front insertion is `reverse_step_order=True`;
"the last `sink` of the prompt as the sink" is the prompt registered back to
front as a *source* shared by every request in that voice, with
`SinkWindow(sink, L)`, a retention that depends on the prompt's length; each
(solver step, block) pair is its own cache layer, so
`num_layers = solver_steps * blocks`.

Classifier-free guidance runs two rows per request (conditional and with
the speech tokens dropped) that share a stream position but hold different
keys (`rows_per_request=2`); the velocity is `v_u + w (v_c - v_u)`.

Attention carries no positions (the frames' order reaches the model through
its conditioning only), so the stream is the pipeline's cache read back to
front: the prompt reversed, then each chunk written last-first. A request's
final chunk is fed as `Chunk(inputs, span=0)`: its frames are attended as
look-ahead and never written, since nothing will read them.

`pipeline_stream` runs the pipeline's own rule above in plain tensor code,
one request at a time, and the same model runs without a bounded cache
(`flexkv.model.uncached`); `python examples/streaming_tts.py` streams flexkv
and the uncached twin, checks flexkv against the pipeline's own cache, and
prints frames per second, the cache's memory and the largest deviations.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from flexkv import BoundedKVConfig, BoundedKVManager, Chunk, SinkWindow, StreamSession, UncachedHistory
from flexkv.model.wrap import attention


@dataclass(frozen=True)
class TTSConfig:
    """Model width, solver and cache policy of the streaming DiT."""

    mel: int = 16
    dim: int = 64
    heads: int = 4
    blocks: int = 2
    solver_steps: int = 3
    ffn: int = 128
    vocab: int = 64  # speech tokens, one per frame
    chunk: int = 50
    sink: int = 100  # the cache keeps its oldest `sink` frames (the prompt's last) and its newest L (prompt length)
    max_prompt: int = 80
    max_prompts: int = 2
    guidance: float = 2.0
    max_requests: int = 4

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def layers(self) -> int:
        return self.solver_steps * self.blocks

    def cache_config(self) -> BoundedKVConfig:
        sink = self.sink
        return BoundedKVConfig(
            num_layers=self.layers,
            num_heads=self.heads,
            head_dim=self.head_dim,
            rows_per_request=2,  # conditional, unconditional
            max_source_len=self.max_prompt,
            # `cache[:L] + cache[-sink:]` of a cache the chunks enter at the front: the stream (that cache
            # back to front) keeps its first `sink` entries (the prompt's last frames) and its last L
            retention=lambda prompt_len: SinkWindow(sink, prompt_len),
            max_slots=self.max_requests,
            reverse_step_order=True,
            max_step_tokens=self.chunk,
            max_sources=self.max_prompts,
        )


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of flow times `t` `[N]` -> `[N, dim]`."""
    half = dim // 2
    freqs = torch.exp(-math.log(1000.0) * torch.arange(half, dtype=torch.float32) / half)
    ang = 1000.0 * t.float().unsqueeze(-1) * freqs
    return torch.cat([ang.cos(), ang.sin()], dim=-1)


class DiTBlock(nn.Module):
    """adaLN-zero transformer block; attention goes through `core` (`(q, k, v) -> out`)."""

    def __init__(self, cfg: TTSConfig, core: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.norm1 = nn.LayerNorm(cfg.dim, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm2 = nn.LayerNorm(cfg.dim, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, cfg.ffn), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn, cfg.dim))
        self.ada = nn.Linear(cfg.dim, 6 * cfg.dim)
        self.core = core

    def forward(self, x, temb):  # x [N, T, dim], temb [N, dim]
        N, T, _ = x.shape
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(F.silu(temb)).unsqueeze(1).chunk(6, dim=-1)
        h = self.norm1(x) * (1 + scale1) + shift1
        q, k, v = self.qkv(h).view(N, T, 3, self.cfg.heads, self.cfg.head_dim).permute(2, 0, 3, 1, 4)
        a = self.core(q, k, v).transpose(1, 2).reshape(N, T, -1)
        x = x + gate1 * self.proj(a)
        h = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.mlp(h)


class FlowDiT(nn.Module):
    """Velocity field `v(x_t, t, tokens)`, solved with Euler steps; layer `s * blocks + b` is step `s`, block `b`."""

    def __init__(self, cfg: TTSConfig, core: Callable[[int], nn.Module]):
        super().__init__()
        self.cfg = cfg
        # `vocab=0`: no speech tokens; the conditioning comes as features (`solve`), from an encoder
        self.token_embed = nn.Embedding(cfg.vocab, cfg.dim) if cfg.vocab else None
        self.in_proj = nn.Linear(cfg.mel + cfg.dim, cfg.dim)
        self.time_mlp = nn.Sequential(nn.Linear(cfg.dim, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim))
        self.blocks = nn.ModuleList()
        for s in range(cfg.solver_steps):
            for b in range(cfg.blocks):
                # weights are shared across solver steps; the cache layer is not
                self.blocks.append(DiTBlock(cfg, core(s * cfg.blocks + b)))
                if s:
                    blk, first = self.blocks[-1], self.blocks[b]
                    for name in ("qkv", "proj", "mlp", "ada"):
                        setattr(blk, name, getattr(first, name))
        self.out_norm = nn.LayerNorm(cfg.dim, eps=1e-6)
        self.out_proj = nn.Linear(cfg.dim, cfg.mel)

    def cond(self, tokens: torch.Tensor) -> torch.Tensor:
        """`tokens [B, T]` -> per-row conditioning `[2B, T, dim]`: conditional rows, then zeros (dropped)."""
        return self.guidance_rows(self.token_embed(tokens))

    @staticmethod
    def guidance_rows(c: torch.Tensor) -> torch.Tensor:
        """Per-frame features `[B, T, dim]` -> `[2B, T, dim]`: each request's conditional row, then its
        unconditional one (the features dropped)."""
        return torch.stack([c, torch.zeros_like(c)], dim=1).flatten(0, 1)

    def velocity(self, s: int, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Velocity of rows `x [2B, T, mel]` at solver step `s` (attends with layers of step `s`)."""
        t = torch.full((x.shape[0],), s / self.cfg.solver_steps)
        temb = self.time_mlp(timestep_embedding(t, self.cfg.dim))
        h = self.in_proj(torch.cat([x, cond], dim=-1))
        for b in range(self.cfg.blocks):
            h = self.blocks[s * self.cfg.blocks + b](h, temb)
        return self.out_proj(self.out_norm(h))

    def forward(self, noise: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Solve one chunk: `noise [B, T, mel]`, `tokens [B, T]` -> mel `[B, T, mel]`."""
        return self.solve(noise, self.cond(tokens))

    def solve(self, noise: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Solve one chunk with the Euler steps: `noise [B, T, mel]`, per-row conditioning `cond [2B, T, dim]`
        (`cond` or `guidance_rows`) -> mel `[B, T, mel]`."""
        cfg = self.cfg
        x = noise
        dt = 1.0 / cfg.solver_steps
        for s in range(cfg.solver_steps):
            v = self.velocity(s, x.repeat_interleave(2, dim=0), cond).unflatten(0, (-1, 2))
            x = x + dt * (v[:, 1] + cfg.guidance * (v[:, 0] - v[:, 1]))
        return x


class _RecordingAttention(nn.Module):
    """Plain full attention that records its keys and values (encodes a voice prompt)."""

    def __init__(self):
        super().__init__()
        self.kv = None

    def forward(self, q, k, v):
        self.kv = (k, v)
        return F.scaled_dot_product_attention(q, k, v)


@torch.no_grad()
def encode_prompt(model: FlowDiT, mel: torch.Tensor, tokens: Optional[torch.Tensor] = None, *,
                  features: Optional[torch.Tensor] = None):
    """Keys and values of a voice prompt for every layer: two `[layers, 2, heads, L, head_dim]` tensors.

    The prompt's conditioning is its speech tokens `[L]`, or its per-frame `features [L, dim]` for a model
    conditioned on an encoder's output (`vocab=0`).

    At solver step `s` the prompt enters as its clean mel (conditional row:
    with its speech tokens; unconditional row: without), attending only to
    itself; its keys at (step, block) are what later frames read there.
    """
    cfg = model.cfg
    rec = FlowDiT(cfg, lambda i: _RecordingAttention()).eval()
    rec.load_state_dict(model.state_dict())
    cond = rec.cond(tokens.unsqueeze(0)) if features is None else rec.guidance_rows(features.unsqueeze(0))
    x = mel.unsqueeze(0).repeat_interleave(2, dim=0)
    for s in range(cfg.solver_steps):
        rec.velocity(s, x, cond)
    ks = torch.stack([blk.core.kv[0] for blk in rec.blocks])  # [layers, 2, heads, L, hd]
    vs = torch.stack([blk.core.kv[1] for blk in rec.blocks])
    return ks.contiguous(), vs.contiguous()


class PipelineCacheAttention(nn.Module):
    """One layer's attention cache as the streaming pipeline writes it, for one request (its two rows).

    `reset(k, v)` starts it on the voice prompt's keys and values `[2, heads, L, head_dim]`; each call puts
    the chunk in front of the cache, attends it, and keeps the newest `L` and oldest `sink` frames.
    """

    def __init__(self, sink: int):
        super().__init__()
        self.sink = sink
        self.kv = None
        self.prompt_len = 0

    def reset(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv = (k, v)
        self.prompt_len = k.shape[2]

    def forward(self, q, k, v):
        k = torch.cat([k, self.kv[0]], dim=2)  # the new chunk in front of the cache
        v = torch.cat([v, self.kv[1]], dim=2)
        out = F.scaled_dot_product_attention(q, k, v)
        L, sink = self.prompt_len, self.sink
        if k.shape[2] > L + sink:
            k = torch.cat([k[:, :, :L], k[:, :, -sink:]], dim=2)
            v = torch.cat([v[:, :, :L], v[:, :, -sink:]], dim=2)
        self.kv = (k, v)
        return out


@torch.no_grad()
def pipeline_stream(model: FlowDiT, prompt_kv, tokens: torch.Tensor, noises: List[torch.Tensor]) -> torch.Tensor:
    """One request spoken with the pipeline's own caches (`PipelineCacheAttention`), chunk by chunk:
    `prompt_kv` as `encode_prompt` gives it, `tokens [frames]`, the noise of each chunk -> mel `[frames, mel]`."""
    cfg = model.cfg
    own = FlowDiT(cfg, lambda i: PipelineCacheAttention(cfg.sink)).eval()
    own.load_state_dict(model.state_dict())
    for i, blk in enumerate(own.blocks):
        blk.core.reset(prompt_kv[0][i], prompt_kv[1][i])
    T = cfg.chunk
    mels = [own(noise.unsqueeze(0), tokens[c * T:(c + 1) * T].unsqueeze(0))[0] for c, noise in enumerate(noises)]
    return torch.cat(mels)


class Runner:
    """A DiT on a `StreamSession` over one cache (bounded or uncached), compiled or not."""

    def __init__(self, cfg: TTSConfig, cache, compile: bool = False, weights: Optional[dict] = None):
        self.cfg = cfg
        self.session = StreamSession(cache, compile=compile, token_sizes=(cfg.chunk,))
        self.model = FlowDiT(cfg, lambda i: attention(self.session.context, i)).eval().requires_grad_(False)  # inference only: compiled CPU FlexAttention has no backward
        if weights is not None:
            self.model.load_state_dict(weights)

    def forward(self, attn, inputs):
        """The session's model step: `(noise [B, T, mel], tokens [B, T])` -> mel `[B, T, mel]`."""
        noise, tokens = inputs
        return self.model(noise, tokens)

    @classmethod
    def bounded(cls, cfg: TTSConfig, compile: bool = False, weights=None,
                block_size: Optional[int] = None) -> "Runner":
        return cls(cfg, BoundedKVManager(cfg.cache_config(), block_size=block_size), compile, weights)

    @classmethod
    def uncached(cls, cfg: TTSConfig, weights=None) -> "Runner":
        return cls(cfg, UncachedHistory(cfg.cache_config()), False, weights)


@dataclass
class Utterance:
    rid: str
    prompt: int  # index into the registered prompts
    tokens: torch.Tensor  # [frames] speech tokens, frames a multiple of the chunk
    start_step: int = 0
    done_chunks: int = 0

    def chunks(self, chunk: int) -> int:
        return self.tokens.shape[0] // chunk


@torch.no_grad()
def stream(cfg: TTSConfig, runners: List[Runner], prompts, utterances: List[Utterance], seed: int = 0) -> dict:
    """Speak `utterances` on every runner in lockstep, one chunk per request per step.

    `prompts` is a list of `(mel [L, mel], tokens [L])` voice prompts; each is
    encoded once and registered as a source on every runner. Returns
    `steps`, `frames` (generated), `seconds` per runner, `max_dev` (largest
    mel difference of each runner from the last one over every frame),
    `max_abs` (largest mel value, for scale), `mels` (the first runner's
    output per request), `noise` (each request's noise per chunk) and
    `sources` (each prompt's keys and values, in the prompt's order).
    """
    T = cfg.chunk
    sources = [encode_prompt(runners[0].model, mel, tok) for mel, tok in prompts]
    index = []
    for run in runners:
        # the stream is the pipeline's cache back to front: the prompt registered last frame first
        index.append([run.session.add_source(k.flip(-2), v.flip(-2)) for k, v in sources])
    lengths = [mel.shape[0] for mel, _ in prompts]
    g = torch.Generator().manual_seed(seed)
    seconds = [0.0] * len(runners)
    max_dev, max_abs = [0.0] * len(runners), 0.0
    mels = {u.rid: [] for u in utterances}
    noises = {u.rid: [] for u in utterances}
    steps = frames = 0
    while any(u.done_chunks < u.chunks(T) for u in utterances):
        feeds = {}
        for u in utterances:
            if u.start_step > steps or u.done_chunks >= u.chunks(T):
                continue
            if u.done_chunks == 0:  # a new request starts on its voice prompt, shared as a source
                for k, run in enumerate(runners):
                    run.session.start(u.rid, source=index[k][u.prompt], source_len=lengths[u.prompt])
            last = u.done_chunks == u.chunks(T) - 1
            noise = torch.randn(T, cfg.mel, generator=g)
            noises[u.rid].append(noise)
            tokens = u.tokens[u.done_chunks * T:(u.done_chunks + 1) * T]
            feeds[u.rid] = Chunk((noise, tokens), span=0 if last else T)  # the last chunk is read, never written
        outs = []
        for k, run in enumerate(runners):
            t0 = time.perf_counter()
            outs.append(run.session.step(feeds, run.forward))
            seconds[k] += time.perf_counter() - t0
        for u in utterances:
            if u.rid not in feeds:
                continue
            for k in range(len(runners)):
                max_dev[k] = max(max_dev[k], (outs[k][u.rid] - outs[-1][u.rid]).abs().max().item())
            max_abs = max(max_abs, outs[-1][u.rid].abs().max().item())
            mels[u.rid].append(outs[0][u.rid])
            u.done_chunks += 1
            frames += T
            if u.done_chunks == u.chunks(T):
                for run in runners:
                    run.session.finish(u.rid)
        steps += 1
    return {"steps": steps, "frames": frames, "seconds": seconds, "max_dev": max_dev, "max_abs": max_abs,
            "mels": {rid: torch.cat(m) for rid, m in mels.items()}, "noise": noises, "sources": sources}


def pipeline_deviation(cfg: TTSConfig, model: FlowDiT, utterances: List["Utterance"], res: dict) -> float:
    """Largest mel difference of `res["mels"]` (a `stream` run) from each request spoken alone with the
    pipeline's own caches (`pipeline_stream`)."""
    worst = 0.0
    for u in utterances:
        own = pipeline_stream(model, res["sources"][u.prompt], u.tokens, res["noise"][u.rid])
        worst = max(worst, (res["mels"][u.rid] - own).abs().max().item())
    return worst


def make_prompts(cfg: TTSConfig, lengths, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, cfg.mel, generator=g), torch.randint(0, cfg.vocab, (n,), generator=g)) for n in lengths]


def make_utterances(cfg: TTSConfig, chunks, prompts, start_steps=None, seed: int = 1) -> List[Utterance]:
    g = torch.Generator().manual_seed(seed)
    starts = start_steps or [0] * len(chunks)
    return [
        Utterance(f"utt{i}", p, torch.randint(0, cfg.vocab, (c * cfg.chunk,), generator=g), start_step=s)
        for i, (c, p, s) in enumerate(zip(chunks, prompts, starts))
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=200, help="chunks each utterance speaks")
    ap.add_argument("--eager", action="store_true", help="do not torch.compile the bounded model")
    ap.add_argument("--no-check", action="store_true", help="skip the uncached twin (no deviation figure)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's choice); fewer than the free cores avoids stalls")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = TTSConfig()
    bounded = Runner.bounded(cfg, compile=not args.eager)
    runners = [bounded]
    if not args.no_check:
        runners.append(Runner.uncached(cfg, weights=bounded.model.state_dict()))
    prompts = make_prompts(cfg, [60, 80])
    # three utterances in voice 0 (one joining late), one in voice 1
    n = args.chunks
    utts = make_utterances(cfg, [n, n - 5, n, n - 10], [0, 0, 1, 0], start_steps=[0, 0, 3, 8])
    # compile outside the timing, on padding steps of the same shape
    bounded.session.warmup(bounded.forward, (torch.zeros(cfg.chunk, cfg.mel), torch.zeros(cfg.chunk, dtype=torch.long)))
    res = stream(cfg, runners, prompts, utts)
    m = bounded.session.cache
    print(f"streaming TTS flow-matching DiT: {cfg.solver_steps} Euler steps x {cfg.blocks} blocks = {cfg.layers} "
          f"cache layers, {cfg.heads} heads x {cfg.head_dim}, chunk {cfg.chunk} frames, CFG w={cfg.guidance}, "
          f"keeps the newest L (prompt length) and oldest {cfg.sink} frames, "
          f"{'eager' if args.eager else 'compiled'}, "
          f"{torch.get_num_threads()} threads")
    print(f"  {len(utts)} utterances, {res['steps']} steps, {res['frames']} frames "
          f"({res['frames'] // len(utts)} per utterance on average)")
    print(f"  bounded: {res['frames'] / res['seconds'][0]:.0f} frames/s ({1e3 * res['seconds'][0] / res['steps']:.1f} "
          f"ms per chunk step, {cfg.solver_steps} solver steps each)")
    print(f"  memory held: {m.memory_bytes / 2**10:.1f} KiB KV cache ({m.slot_bytes / 2**10:.1f} KiB per request, "
          f"prompts shared)")
    if not args.no_check:
        print(f"  largest |mel| deviation from the uncached model: {res['max_dev'][0]:.2e} "
              f"(largest |mel| value {res['max_abs']:.1f})")
        res["pipeline_dev"] = pipeline_deviation(cfg, bounded.model, utts, res)
        print(f"  largest |mel| deviation from the pipeline's own caches (new chunk in front, "
              f"cache[:L] + cache[-{cfg.sink}:]): {res['pipeline_dev']:.2e}")
    return res


if __name__ == "__main__":
    main()
