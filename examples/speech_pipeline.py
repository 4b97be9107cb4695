"""A whole streaming speech pipeline on flexkv: a two-rate conformer encoder feeding a flow-matching DiT.

The pipeline (random weights, toy widths) turns speech tokens into mel frames
chunk by chunk, the shape of chunk-aware streaming TTS flow modules:

    tokens [25] -> embed -> conformer stack at 25 frames per chunk (its own left-context cache)
                -> causal upsample x2
                -> conformer stack at 50 frames per chunk (its own left-context cache)
                -> projection: the DiT's per-frame conditioning mu [50, dim]
    noise [50, mel], mu -> DiT, `solver_steps` Euler steps, classifier-free guidance (two rows per
                request) over the voice prompt's keys -> mel [50, mel]

Its attention caches follow its own rules, written as such pipelines write
them (`SpeechPipeline` holds them; `own_stream` runs it):

- encoder self-attention (`RelPosSelfAttention`): ESPnet / Transformer-XL
  relative positions with the query-dependent term,
  `((q + u) . k_j + (q + v) . W_pos pe(i - j)) / sqrt(D)`; per layer
  `kv = torch.cat([cache, kv_chunk]); cache = kv[:, :, -window:]`, and the
  chunk attends the cache and all of itself;
- the DiT (`examples.streaming_tts.PipelineCacheAttention`, one per solver
  step and block): `kv = torch.cat([kv_chunk, cache])` (the chunk in *front*),
  `cache = kv[:L] + kv[-100:]`, started on the voice prompt's `L` frames;
- each conformer's convolution and the upsampler's convolution carry their
  last inputs between chunks.

`FlexkvPipeline` ports it with flexkv's public kit, keeping its modules and
weights (docs/models.md, "Conventions"): `swap_attention` on the two
attention classes, and one `MultiCacheSession` over three caches, so a chunk
is one step, atomic across them: "slow" and "fast" for the encoder's stacks
(`SinkWindow(0, window)` each, its own step length, the relative term a
`RelativePosition` table per step, the convolution states as the requests'
`initial_state`) and "dit" for the DiT (`reverse_step_order=True`, the prompt
registered back to front as a source shared by every request in that voice,
`SinkWindow(100, L)`, `rows_per_request=2`).

`python examples/speech_pipeline.py` checks flexkv against the pipeline's own
streaming (each request alone) and the uncached twin (`UncachedHistory` under
every cache), then times a chunk step on flexkv and on the pipeline's own
caches (eager, `--compile` both compiled) and prints memory per stream and the
adapter's size. `--slot-dtype int8` (or `fp8`) stores flexkv's cells in 8 bits
(`BoundedKVConfig.slot_dtype`); the twin then reads the same cells back.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Dict, List

import torch
from torch import nn

from flexkv import MultiCacheSession, RelativePosition, UncachedHistory, swap_attention
from flexkv.cache.storage.quantized import SLOT_DTYPE_NAMES, slot_dtype_named

try:
    from examples.streaming_conformer import ConformerBlock, ConformerConfig
    from examples.streaming_tts import FlowDiT, PipelineCacheAttention, TTSConfig, encode_prompt
except ImportError:  # run as a script from examples/
    from streaming_conformer import ConformerBlock, ConformerConfig
    from streaming_tts import FlowDiT, PipelineCacheAttention, TTSConfig, encode_prompt


@dataclass(frozen=True)
class PipelineConfig:
    """The encoder's two stacks (`slow`: 25 frames per chunk, `fast`: 50) and the DiT (`vocab=0`: it is
    conditioned on the encoder's output)."""

    vocab: int = 64
    slow: ConformerConfig = ConformerConfig(feats=0, dim=64, heads=4, layers=2, chunk=25, lookahead=0, window=50)
    fast: ConformerConfig = ConformerConfig(feats=0, dim=64, heads=4, layers=2, chunk=50, lookahead=0, window=100)
    dit: TTSConfig = TTSConfig(vocab=0, chunk=50)
    upsample: int = 2

    def __post_init__(self):
        s, f, d = self.slow, self.fast, self.dit
        if s.dim != f.dim or f.chunk != self.upsample * s.chunk or d.chunk != f.chunk or s.lookahead or f.lookahead \
                or s.causal or f.causal or d.vocab or not s.max_requests == f.max_requests == d.max_requests:
            raise ValueError(f"PipelineConfig: the stacks share a width, the fast stack and the DiT run "
                             f"upsample x the slow chunk, no look-ahead, dit.vocab=0, one max_requests; got {self}")


# ------------------------------------------------------------------ the pipeline, with its own caches


def rel_encoding(d: torch.Tensor, dim: int) -> torch.Tensor:
    """ESPnet's sinusoidal relative encoding at signed distances `d [R]` -> `[R, dim]` (sin, cos interleaved)."""
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * -(math.log(10000.0) / dim))
    ang = d.double().unsqueeze(1) * div
    return torch.stack([ang.sin(), ang.cos()], dim=-1).flatten(1).float()


class RelPosSelfAttention(nn.Module):
    """ESPnet's relative-position multi-head self-attention with the pipeline's own left-context cache.

    Scores `((q_i + u) . k_j + (q_i + v) . p(i - j)) / sqrt(D)`, `p(d) = linear_pos(pe(d))`. `forward`
    streams: the chunk's keys go after the cache, the chunk attends all of them, and the cache keeps the
    last `window` frames (`reset()` empties it).
    """

    def __init__(self, cfg: ConformerConfig):
        super().__init__()
        self.cfg = cfg
        self.linear_q, self.linear_k, self.linear_v, self.linear_out = (nn.Linear(cfg.dim, cfg.dim) for _ in range(4))
        self.linear_pos = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.randn(cfg.heads, cfg.head_dim) * 0.3)
        self.pos_bias_v = nn.Parameter(torch.randn(cfg.heads, cfg.head_dim) * 0.3)
        self.cache = None

    def reset(self) -> None:
        self.cache = None

    def heads(self, x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:  # [N, T, dim] -> [N, H, T, D]
        return lin(x).view(x.shape[0], x.shape[1], self.cfg.heads, self.cfg.head_dim).transpose(1, 2)

    def bias(self, p: torch.Tensor) -> torch.Tensor:  # [H, D] -> [1, H, 1, D]
        return p.view(1, self.cfg.heads, 1, self.cfg.head_dim)

    def merge(self, out: torch.Tensor) -> torch.Tensor:  # [N, H, T, D] -> [N, T, dim]
        return self.linear_out(out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        N, T, _ = x.shape
        H, D = self.cfg.heads, self.cfg.head_dim
        q, k, v = (self.heads(x, lin) for lin in (self.linear_q, self.linear_k, self.linear_v))
        if self.cache is not None:
            k, v = torch.cat([self.cache[0], k], dim=2), torch.cat([self.cache[1], v], dim=2)
        Lk = k.shape[2]
        # distances Lk - 1 .. -(T - 1): column c is distance Lk - 1 - c; query i (key index Lk - T + i)
        # against key j is distance Lk - T + i - j, column T - 1 - i + j
        p = self.linear_pos(rel_encoding(Lk - 1 - torch.arange(Lk + T - 1), self.cfg.dim).to(x))
        p = p.view(-1, H, D).transpose(0, 1)  # [H, R, D]
        ac = (q + self.bias(self.pos_bias_u)) @ k.transpose(-1, -2)
        bd = (q + self.bias(self.pos_bias_v)) @ p.transpose(-1, -2)  # [N, H, T, R]
        col = (T - 1 - torch.arange(T).view(-1, 1) + torch.arange(Lk).view(1, -1)).expand(N, H, T, Lk)
        bd = bd.gather(-1, col)
        out = torch.softmax((ac + bd) / math.sqrt(D), dim=-1) @ v
        self.cache = (k[:, :, -self.cfg.window:], v[:, :, -self.cfg.window:])
        return self.merge(out)


class CausalUpsample(nn.Module):
    """Nearest-neighbour upsampling by `factor`, then a causal convolution (kernel `2 factor + 1`) whose last
    `2 factor` inputs are carried between chunks."""

    def __init__(self, dim: int, factor: int):
        super().__init__()
        self.factor = factor
        self.conv = nn.Conv1d(dim, dim, 2 * factor + 1)

    def forward(self, x: torch.Tensor, state: torch.Tensor):  # x [N, T, dim], state [N, dim, 2 factor]
        h = torch.cat([state, x.repeat_interleave(self.factor, dim=1).transpose(1, 2)], dim=2)
        return self.conv(h).transpose(1, 2), h[:, :, -2 * self.factor:]


class SpeechEncoder(nn.Module):
    """tokens `[N, T]` -> the DiT's conditioning `[N, upsample T, dit.dim]`, through both stacks."""

    def __init__(self, cfg: PipelineConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.slow.dim)
        self.slow = nn.ModuleList(ConformerBlock(cfg.slow, attention=RelPosSelfAttention(cfg.slow))
                                  for _ in range(cfg.slow.layers))
        self.up = CausalUpsample(cfg.slow.dim, cfg.upsample)
        self.fast = nn.ModuleList(ConformerBlock(cfg.fast, attention=RelPosSelfAttention(cfg.fast))
                                  for _ in range(cfg.fast.layers))
        self.proj = nn.Linear(cfg.fast.dim, cfg.dit.dim)

    def initial_state(self) -> Dict[str, torch.Tensor]:
        """One stream's convolution state before its first chunk (zeros, no batch dimension)."""
        s, f = self.cfg.slow, self.cfg.fast
        return {"slow": torch.zeros(s.layers, s.dim, s.kernel - 1), "up": torch.zeros(s.dim, 2 * self.cfg.upsample),
                "fast": torch.zeros(f.layers, f.dim, f.kernel - 1)}

    def forward(self, tokens: torch.Tensor, state: Dict[str, torch.Tensor]):
        x = self.embed(tokens)
        new = {}
        for name, stack in (("slow", self.slow), ("fast", self.fast)):
            if name == "fast":
                x, new["up"] = self.up(x, state["up"])
            states = []
            for i, block in enumerate(stack):
                x, s = block(x, state[name][:, i], x.shape[1])
                states.append(s)
            new[name] = torch.stack(states, dim=1)
        return self.proj(x), new


class SpeechPipeline(nn.Module):
    """The encoder and the DiT, each attention on the pipeline's own cache; `forward` is one chunk."""

    def __init__(self, cfg: PipelineConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = SpeechEncoder(cfg)
        self.dit = FlowDiT(cfg.dit, lambda i: PipelineCacheAttention(cfg.dit.sink))

    def reset(self, prompt_kv, batch: int = 1) -> None:
        """Empty the encoder's caches and start every DiT cache on the voice prompt (`encode_prompt`'s
        keys and values), the same voice for `batch` requests."""
        for m in self.encoder.modules():
            if isinstance(m, RelPosSelfAttention):
                m.reset()
        for i, blk in enumerate(self.dit.blocks):
            blk.core.reset(prompt_kv[0][i].repeat(batch, 1, 1, 1), prompt_kv[1][i].repeat(batch, 1, 1, 1))

    def initial_state(self, batch: int = 1):
        return {k: v.expand(batch, *v.shape).clone() for k, v in self.encoder.initial_state().items()}

    def forward(self, tokens: torch.Tensor, noise: torch.Tensor, state):
        """`tokens [B, 25]`, `noise [B, 50, mel]`, the encoder's state -> mel `[B, 50, mel]`, the next state."""
        mu, state = self.encoder(tokens, state)
        return self.dit.solve(noise, FlowDiT.guidance_rows(mu)), state


def encode_voice(pipe: SpeechPipeline, mel: torch.Tensor, features: torch.Tensor):
    """A voice prompt's keys and values in every DiT layer (`mel [L, mel]`, its conditioning `features [L, dim]`)."""
    return encode_prompt(pipe.dit, mel, features=features)


@torch.no_grad()
def own_stream(pipe: SpeechPipeline, prompt_kv, tokens: torch.Tensor, noises: List[torch.Tensor]) -> torch.Tensor:
    """One request spoken with the pipeline's own caches, chunk by chunk: `tokens [25 n]`, the noise of each
    chunk `[50, mel]` -> mel `[50 n, mel]`."""
    own = copy.deepcopy(pipe)
    own.reset(prompt_kv)
    state, T = own.initial_state(), pipe.cfg.slow.chunk
    mels = []
    for c, noise in enumerate(noises):
        mel, state = own(tokens[c * T:(c + 1) * T].unsqueeze(0), noise.unsqueeze(0), state)
        mels.append(mel[0])
    return torch.cat(mels)


# ------------------------------------------------------------------ the port: the adapter


def rel_attention_on_flexkv(rel: RelativePosition):
    """`RelPosSelfAttention.forward` on a flexkv core: the same projections and biases; the position term a
    per-step table at the stream distances (`rel.scores`), the cache flexkv's."""

    def forward(self: RelPosSelfAttention, attn, x: torch.Tensor) -> torch.Tensor:
        H, D = self.cfg.heads, self.cfg.head_dim
        q, k, v = (self.heads(x, lin) for lin in (self.linear_q, self.linear_k, self.linear_v))
        pos = self.linear_pos(rel_encoding(rel.distances(), self.cfg.dim).to(x)).view(rel.size, H, D)
        term = rel.scores(q + self.bias(self.pos_bias_v), pos, attn.stream_positions())
        return self.merge(attn.context.attend(attn.layer_idx, q + self.bias(self.pos_bias_u), k, v, score_mod=term))

    return forward


def dit_attention_on_flexkv(self: PipelineCacheAttention, attn, q, k, v):
    return attn(q, k, v)


class FlexkvPipeline:
    """A copy of `pipe` whose caches are flexkv's, all three in one `MultiCacheSession`: "slow" and "fast"
    (the encoder's stacks) and "dit" (the DiT, the voice prompts its shared sources); one chunk is one step
    of the session over the three. `uncached=True` puts `UncachedHistory` under every cache (the twin, eager
    only)."""

    def __init__(self, pipe: SpeechPipeline, *, uncached: bool = False, compile: bool = False, slot_dtype=None):
        cfg = self.cfg = pipe.cfg
        self.model = model = copy.deepcopy(pipe).requires_grad_(False)
        configs = {"slow": cfg.slow.cache_config(), "fast": cfg.fast.cache_config(), "dit": cfg.dit.cache_config()}
        # Quantized slots (`--slot-dtype`): every cell of the three caches in 8 bits, prompts included.
        configs = {n: dataclasses.replace(c, slot_dtype=slot_dtype) for n, c in configs.items()}
        self.session = MultiCacheSession(
            {n: UncachedHistory(c) if uncached else c for n, c in configs.items()}, compile=compile,
            when_full="refuse", token_sizes={"slow": (cfg.slow.chunk,), "fast": (cfg.fast.chunk,),
                                             "dit": (cfg.dit.chunk,)},
            initial_state=model.encoder.initial_state)
        for name in ("slow", "fast"):
            swap_attention(getattr(model.encoder, name), self.session.context[name], RelPosSelfAttention,
                           rel_attention_on_flexkv(RelativePosition(configs[name])))
        swap_attention(model.dit, self.session.context["dit"], PipelineCacheAttention, dit_attention_on_flexkv)
        self.voices: List[tuple] = []  # (source index in "dit", prompt length)

        def step(attn, x, state):  # x["fast"] only gives the fast cache its step length (50 frames)
            mu, state = model.encoder(x["slow"], state)
            return {"dit": model.dit.solve(x["dit"], FlowDiT.guidance_rows(mu))}, state  # cut to each request

        self._step = step

    def add_voice(self, prompt_kv) -> int:
        """Register a voice prompt's keys and values (`encode_voice`) back to front in the "dit" cache, a
        source shared by every request in that voice; returns the voice's index."""
        k, v = prompt_kv
        self.voices.append((self.session.add_source("dit", k.flip(-2), v.flip(-2)), k.shape[-2]))
        return len(self.voices) - 1

    def start(self, rid, voice: int) -> None:
        self.session.start(rid, sources={"dit": self.voices[voice]})

    def finish(self, rid) -> None:
        self.session.finish(rid)

    def step(self, feeds: Dict) -> Dict:
        """One chunk for each request: `feeds[rid] = (tokens [25], noise [50, mel])` -> mel `[50, mel]`."""
        empty = torch.zeros(self.cfg.fast.chunk, 0)
        out = self.session.step({rid: {"slow": tok, "fast": empty, "dit": noise} for rid, (tok, noise) in feeds.items()},
                                self._step)
        return {rid: out[rid]["dit"] for rid in feeds}

    def warmup(self) -> float:
        """Compile the session's step on padding; seconds taken."""
        c = self.cfg
        return self.session.warmup(self._step, {"slow": torch.zeros(c.slow.chunk, dtype=torch.long),
                                                "fast": torch.zeros(c.fast.chunk, 0),
                                                "dit": torch.zeros(c.dit.chunk, c.dit.mel)})

    def slot_bytes(self) -> int:
        """KV memory one stream holds in the three caches (the voice prompts, shared, not counted)."""
        return sum(c.slot_bytes for c in self.session.caches.values())


# ------------------------------------------------------------------ streaming requests, checking, timing


@dataclass
class Request:
    rid: str
    voice: int
    tokens: torch.Tensor  # [25 n] speech tokens
    start_step: int = 0
    done: int = 0  # chunks spoken

    def chunks(self, T: int) -> int:
        return self.tokens.shape[0] // T


def make_voices(cfg: PipelineConfig, lengths, seed: int = 0):
    """Voice prompts: `(mel [L, mel], features [L, dim])`, the features standing for what the encoder made of
    the prompt's speech tokens."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, cfg.dit.mel, generator=g), torch.randn(n, cfg.dit.dim, generator=g)) for n in lengths]


def make_requests(cfg: PipelineConfig, chunks, voices, start_steps=None, seed: int = 1) -> List[Request]:
    g = torch.Generator().manual_seed(seed)
    starts = start_steps or [0] * len(chunks)
    return [Request(f"utt{i}", p, torch.randint(0, cfg.vocab, (c * cfg.slow.chunk,), generator=g), start_step=s)
            for i, (c, p, s) in enumerate(zip(chunks, voices, starts))]


@torch.no_grad()
def stream(cfg: PipelineConfig, ports: List[FlexkvPipeline], voice_kvs, requests: List[Request], seed: int = 2):
    """Speak `requests` on every port in lockstep, one chunk per request per step (each voice registered on
    every port). Returns `mels` (per port, rid -> `[50 n, mel]`), `noise` (rid -> each chunk's), `steps`."""
    T = cfg.slow.chunk
    voices = [[port.add_voice(kv) for kv in voice_kvs] for port in ports]
    g = torch.Generator().manual_seed(seed)
    mels = [{r.rid: [] for r in requests} for _ in ports]
    noise = {r.rid: [] for r in requests}
    steps = 0
    while any(r.done < r.chunks(T) for r in requests):
        feeds = {}
        for r in requests:
            if r.start_step > steps or r.done >= r.chunks(T):
                continue
            if r.done == 0:
                for port, ids in zip(ports, voices):
                    port.start(r.rid, ids[r.voice])
            noise[r.rid].append(torch.randn(cfg.dit.chunk, cfg.dit.mel, generator=g))
            feeds[r.rid] = (r.tokens[r.done * T:(r.done + 1) * T], noise[r.rid][-1])
        for port, out in zip(ports, mels):
            got = port.step(feeds)
            for rid in feeds:
                out[rid].append(got[rid])
        for r in requests:
            if r.rid in feeds:
                r.done += 1
                if r.done == r.chunks(T):
                    for port in ports:
                        port.finish(r.rid)
        steps += 1
    return {"mels": [{rid: torch.cat(m) for rid, m in out.items()} for out in mels], "noise": noise, "steps": steps}


def own_deviation(pipe: SpeechPipeline, voice_kvs, requests: List[Request], res: dict, port: int = 0) -> float:
    """Largest mel difference of port `port`'s output in `res` (a `stream` run over `requests`) from each
    request spoken alone on the pipeline's own caches (`own_stream`, the same noise)."""
    worst = 0.0
    for r in requests:
        own = own_stream(pipe, voice_kvs[r.voice], r.tokens, res["noise"][r.rid])
        worst = max(worst, (res["mels"][port][r.rid] - own).abs().max().item())
    return worst


def adapter_lines() -> int:
    """Lines of the port (`rel_attention_on_flexkv`, `dit_attention_on_flexkv`, `FlexkvPipeline`), docstrings,
    comments and blank lines left out."""
    n = 0
    for obj in (rel_attention_on_flexkv, dit_attention_on_flexkv, FlexkvPipeline):
        in_doc = False
        for line in inspect.getsource(obj).splitlines():
            s = line.strip()
            if s.startswith('"""'):
                in_doc = not (len(s) > 3 and s.endswith('"""')) if not in_doc else False
                continue
            if in_doc:
                in_doc = not s.endswith('"""')
                continue
            if s and not s.startswith("#"):
                n += 1
    return n


def own_cache_bytes(pipe: SpeechPipeline) -> int:
    """Bytes the pipeline's own attention caches hold now (every request of its batch)."""
    n = 0
    for m in pipe.modules():
        kv = getattr(m, "cache", None) if isinstance(m, RelPosSelfAttention) else getattr(m, "kv", None)
        if isinstance(m, (RelPosSelfAttention, PipelineCacheAttention)) and kv is not None:
            n += sum(t.numel() * t.element_size() for t in kv)
    return n


@torch.no_grad()
def timing(pipe: SpeechPipeline, voice_kv, streams: int, chunks: int, compile: bool, skip: int = 4,
           slot_dtype=None) -> dict:
    """ms per chunk step for `streams` requests in one voice, in lockstep: the pipeline's own caches (batched)
    and flexkv (its cells in `slot_dtype`), taken alternately in one process; medians over the chunks after
    the first `skip` (the own caches grow until then). Compiled: the compile seconds of each (flexkv: both
    sessions' warm-up)."""
    from torch._dynamo.utils import counters

    cfg = pipe.cfg
    T = cfg.slow.chunk
    own = copy.deepcopy(pipe).requires_grad_(False)
    own.reset(voice_kv, batch=streams)
    own_step = torch.compile(own, dynamic=False) if compile else own
    port = FlexkvPipeline(pipe, compile=compile, slot_dtype=slot_dtype)
    voice = port.add_voice(voice_kv)
    compile_s = {"flexkv": port.warmup() if compile else 0.0, "own": 0.0}
    own_graphs = 0
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab, (streams, chunks * T), generator=g)
    state = own.initial_state(streams)
    rids = [f"s{i}" for i in range(streams)]
    for rid in rids:
        port.start(rid, voice)
    times = {"own": [], "flexkv": []}
    worst = 0.0
    for c in range(chunks):
        noise = torch.randn(streams, cfg.dit.chunk, cfg.dit.mel, generator=g)
        tok = tokens[:, c * T:(c + 1) * T]
        graphs = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        mel, state = own_step(tok, noise, state)
        dt = time.perf_counter() - t0
        if counters["stats"]["unique_graphs"] != graphs:  # this call compiled (the own caches changed shape)
            compile_s["own"] += dt
            own_graphs += counters["stats"]["unique_graphs"] - graphs
        elif c >= skip:
            times["own"].append(dt)
        t0 = time.perf_counter()
        out = port.step({rid: (tok[i], noise[i]) for i, rid in enumerate(rids)})
        dt = time.perf_counter() - t0
        if c >= skip:
            times["flexkv"].append(dt)
        worst = max(worst, max((out[rid] - mel[i]).abs().max().item() for i, rid in enumerate(rids)))
    return {"ms": {k: 1e3 * statistics.median(v) for k, v in times.items()}, "compile_s": compile_s,
            "own_graphs": own_graphs,
            "max_dev": worst, "own_bytes": own_cache_bytes(own) // streams, "flexkv_bytes": port.slot_bytes(),
            "source_bytes": sum(t.numel() * t.element_size() for t in voice_kv),
            "samples": len(times["own"])}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=12, help="chunks each request speaks in the check")
    ap.add_argument("--time-chunks", type=int, default=24, help="chunks of the timed run")
    ap.add_argument("--compile", action="store_true", help="also time both compiled (cold and warm compile)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--slot-dtype", default="none", choices=["none", *SLOT_DTYPE_NAMES],
                    help="flexkv's cells in 8 bits with a scale per cell and head (default: the model's dtype)")
    args = ap.parse_args(argv)
    slot_dtype = slot_dtype_named(args.slot_dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = PipelineConfig()
    pipe = SpeechPipeline(cfg).eval().requires_grad_(False)
    kvs = [encode_voice(pipe, mel, feat) for mel, feat in make_voices(cfg, [60, 80])]
    n = args.chunks
    # three requests in voice 0 (one joining late), one in voice 1
    reqs = make_requests(cfg, [n, n - 3, n, n - 5], [0, 0, 1, 0], start_steps=[0, 0, 2, 4])
    res = stream(cfg, [FlexkvPipeline(pipe, slot_dtype=slot_dtype),
                       FlexkvPipeline(pipe, uncached=True, slot_dtype=slot_dtype)], kvs, reqs)
    s, f, d = cfg.slow, cfg.fast, cfg.dit
    print(f"streaming speech pipeline: encoder {s.layers} layers at {s.chunk} frames per chunk (left context "
          f"{s.window}), upsample x{cfg.upsample}, {f.layers} layers at {f.chunk} (left context {f.window}), width "
          f"{s.dim}, rel-pos attention; DiT {d.solver_steps} Euler steps x {d.blocks} blocks = {d.layers} cache layers, "
          f"width {d.dim}, CFG rows, keeps cache[:L] + cache[-{d.sink}:]; flexkv's cells "
          f"{args.slot_dtype if slot_dtype is not None else 'unquantized'}; {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"  check: {len(reqs)} requests, 2 voices, {res['steps']} steps; largest |mel| deviation from the "
          f"pipeline's own streaming {own_deviation(pipe, kvs, reqs, res):.2e}, from the uncached twin "
          f"{max((res['mels'][0][r] - res['mels'][1][r]).abs().max().item() for r in res['mels'][0]):.2e} "
          f"(largest |mel| {max(m.abs().max().item() for m in res['mels'][0].values()):.1f})")
    print(f"  adapter: {adapter_lines()} lines (rel_attention_on_flexkv, dit_attention_on_flexkv, FlexkvPipeline)")
    modes = [False, True] if args.compile else [False]
    for compile in modes:
        t = timing(pipe, kvs[0], cfg.dit.max_requests, args.time_chunks, compile, slot_dtype=slot_dtype)
        mode = "compiled" if compile else "eager"
        print(f"  {mode}, {cfg.dit.max_requests} streams in lockstep, median of {t['samples']} chunk steps: own "
              f"caches {t['ms']['own']:.1f} ms, flexkv {t['ms']['flexkv']:.1f} ms ({t['ms']['flexkv'] / t['ms']['own']:.2f}x); "
              f"largest deviation {t['max_dev']:.1e}")
        if compile:
            print(f"    compile: own {t['compile_s']['own']:.1f} s ({t['own_graphs']} graphs: its caches change length "
                  f"and layout over the first chunks), flexkv {t['compile_s']['flexkv']:.1f} s (the session's warm-up, "
                  f"one graph)")
        print(f"    KV memory per stream: own {t['own_bytes'] / 2**10:.0f} KiB, flexkv {t['flexkv_bytes'] / 2**10:.0f} KiB "
              f"(+ the voice prompt, shared: {t['source_bytes'] / 2**10:.0f} KiB per voice)")
    if args.compile:  # the same compile again in this process: inductor's caches are warm now
        torch._dynamo.reset()
        t0 = time.perf_counter()
        port = FlexkvPipeline(pipe, compile=True, slot_dtype=slot_dtype)
        port.add_voice(kvs[0])
        port.warmup()
        print(f"    flexkv compile again, warm caches: {time.perf_counter() - t0:.1f} s")
    return res


if __name__ == "__main__":
    main()
