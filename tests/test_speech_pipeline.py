"""The streaming speech pipeline (two-rate relative-position conformer encoder -> CFG flow-matching DiT over a
shared voice prompt) ported to flexkv computes what the pipeline's own caches compute, written as it writes
them (plain tensor code, each request alone), and what the uncached twin computes: every frame of every chunk
of several requests in two voices, batched, one joining late, past every cache's retention."""

import pytest
import torch

from examples.speech_pipeline import (
    FlexkvPipeline,
    PipelineConfig,
    SpeechPipeline,
    encode_voice,
    make_requests,
    make_voices,
    own_deviation,
    stream,
)
from examples.streaming_conformer import ConformerConfig
from examples.streaming_tts import TTSConfig
from flexkv import SinkWindow
from single_thread import one_thread  # noqa: F401  (autouse: one torch thread per module)

# slow stack: 25 frames per chunk, 40 kept; fast stack: 50 per chunk, 70 kept; the DiT keeps the newest L
# (prompt length, 30 or 17) and the oldest 20 frames (less than a prompt: the 30-frame prompt's last 20, so its
# order matters), over 2 Euler steps x 1 block
CFG = PipelineConfig(
    vocab=32,
    slow=ConformerConfig(feats=0, dim=32, heads=2, layers=1, chunk=25, lookahead=0, window=40, max_requests=3),
    fast=ConformerConfig(feats=0, dim=32, heads=2, layers=1, chunk=50, lookahead=0, window=70, max_requests=3),
    dit=TTSConfig(mel=8, dim=32, heads=2, blocks=1, solver_steps=2, ffn=64, vocab=0, chunk=50, sink=20,
                  max_prompt=30, max_requests=3),
)
#: (chunks, voice, first step): two requests share voice 0, the second joins a step late; one speaks in voice 1
REQUESTS = ([5, 4, 3], [0, 0, 1], [0, 1, 0])


@pytest.fixture(scope="module")
def pipeline():
    torch.manual_seed(0)
    pipe = SpeechPipeline(CFG).eval().requires_grad_(False)
    return pipe, [encode_voice(pipe, mel, feat) for mel, feat in make_voices(CFG, [30, 17])]


def _scale(res) -> float:
    return max(1.0, max(m.abs().max().item() for m in res["mels"][0].values()))


def test_port_follows_the_pipelines_own_streaming_and_the_uncached_twin(pipeline):
    pipe, kvs = pipeline
    reqs = make_requests(CFG, *REQUESTS)
    bounded, twin = FlexkvPipeline(pipe), FlexkvPipeline(pipe, uncached=True)
    res = stream(CFG, [bounded, twin], kvs, reqs)
    assert res["steps"] == 5
    # every cache's retention is passed: 125 frames through a 40-frame and 250 through a 70-frame left context,
    # 250 through the DiT's 20 + L
    assert 5 * CFG.slow.chunk > CFG.slow.window + CFG.slow.chunk and 5 * CFG.dit.chunk > CFG.dit.sink + 30
    # each prompt registered once in the DiT's cache, read by its requests; the encoder's caches hold none
    assert bounded.session.caches["dit"].sources == {0: 30, 1: 17}
    assert not bounded.session.caches["slow"].sources and not bounded.session.caches["fast"].sources
    tol = 1e-4 * _scale(res)
    assert own_deviation(pipe, kvs, reqs, res, port=0) < tol
    assert own_deviation(pipe, kvs, reqs, res, port=1) < tol
    for rid, mel in res["mels"][0].items():
        assert mel.shape == (len(res["noise"][rid]) * CFG.dit.chunk, CFG.dit.mel)
        assert (mel - res["mels"][1][rid]).abs().max().item() < tol
    mels = res["mels"][0]
    assert (mels["utt0"][:50] - mels["utt1"][:50]).abs().max() > 1e-2  # other tokens, other speech


def test_a_wrong_cache_mapping_is_seen(pipeline, monkeypatch):
    """The check is not blind: "the whole prompt as the sink + the last 20" for the DiT, the prompt registered
    in its own order (not back to front), or a left context one frame short in the slow stack, is far off the
    pipeline's own streaming."""
    pipe, kvs = pipeline
    dit_config, enc_config = TTSConfig.cache_config, ConformerConfig.cache_config
    with monkeypatch.context() as m:
        m.setattr(TTSConfig, "cache_config", lambda self: dit_config(self).replace(
            retention=lambda L, n=self.sink: SinkWindow(L, n)))
        reqs = make_requests(CFG, *REQUESTS)
        res = stream(CFG, [FlexkvPipeline(pipe)], kvs, reqs)
        assert own_deviation(pipe, kvs, reqs, res) > 5e-3
    with monkeypatch.context() as m:
        m.setattr(FlexkvPipeline, "add_voice", lambda self, kv: (self.voices.append(
            (self.session.add_source("dit", *kv), kv[0].shape[-2])), len(self.voices) - 1)[1])
        reqs = make_requests(CFG, *REQUESTS)
        res = stream(CFG, [FlexkvPipeline(pipe)], kvs, reqs)
        assert own_deviation(pipe, kvs, reqs, res) > 5e-3
    with monkeypatch.context() as m:
        m.setattr(ConformerConfig, "cache_config", lambda self: enc_config(self).replace(
            retention=SinkWindow(0, self.window - (self.chunk == 25))))
        reqs = make_requests(CFG, *REQUESTS)
        res = stream(CFG, [FlexkvPipeline(pipe)], kvs, reqs)
        assert own_deviation(pipe, kvs, reqs, res) > 5e-3


def test_a_chunk_whose_dit_fails_changes_no_cache(pipeline):
    """The three caches step as one: a chunk whose DiT raises after the encoder ran leaves every cache's written
    count and the encoder's carried state as they were, and the stream goes on as if it had not been fed."""
    pipe, kvs = pipeline
    port = FlexkvPipeline(pipe)
    port.start("a", port.add_voice(kvs[0]))
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, CFG.vocab, (3 * 25,), generator=g)
    noises = [torch.randn(50, CFG.dit.mel, generator=g) for _ in range(3)]
    got = [port.step({"a": (tokens[:25], noises[0])})["a"]]
    written, state = port.session.written("a"), {k: v.clone() for k, v in port.session.state("a").items()}
    assert written == {"slow": 25, "fast": 50, "dit": 50}
    with pytest.raises(RuntimeError, match="cannot be multiplied"):  # a noise one mel bin too wide: the DiT raises
        port.step({"a": (tokens[25:50], torch.randn(50, CFG.dit.mel + 1))})
    assert port.session.written("a") == written
    assert all(torch.equal(port.session.state("a")[k], v) for k, v in state.items())
    got += [port.step({"a": (tokens[25 * c:25 * (c + 1)], noises[c])})["a"] for c in (1, 2)]
    res = {"mels": [{"a": torch.cat(got)}], "noise": {"a": noises}}
    req = make_requests(CFG, [3], [0])[0]
    req.rid, req.tokens = "a", tokens
    assert own_deviation(pipe, kvs, [req], res) < 1e-4 * _scale(res)
