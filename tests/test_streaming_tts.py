"""The streaming flow-matching DiT streamed through flexkv computes what it
computes without a bounded cache, and what the pipeline's own cache rule
(new chunk in front, keep `cache[:L] + cache[-100:]`, written out in plain
tensor code) computes: every frame of every chunk of every request."""

import torch

from examples.streaming_tts import Runner, TTSConfig, make_prompts, make_utterances, pipeline_deviation, stream
from flexkv import BoundedKVManager, SinkWindow
from single_thread import one_thread  # noqa: F401  (autouse: one torch thread per module)

# 2 Euler steps x 1 block = 2 cache layers; chunks of 50 frames; the cache keeps the newest L (prompt length)
# and the oldest 100 frames
CFG = TTSConfig(mel=8, dim=32, heads=2, blocks=1, solver_steps=2, ffn=64, vocab=32, chunk=50, sink=100,
                max_prompt=30, max_requests=3)


def _check(bounded):
    uncached = Runner.uncached(CFG, weights=bounded.model.state_dict())
    prompts = make_prompts(CFG, [30, 17])
    # two requests share voice 0 (one joins a step late), one speaks in voice 1 and leaves early
    utts = make_utterances(CFG, [5, 3, 2], [0, 0, 1], start_steps=[0, 1, 0])
    res = stream(CFG, [bounded, uncached], prompts, utts)
    m = bounded.session.cache
    assert m.sources == {0: 30, 1: 17}  # each prompt registered once, read by every request in its voice
    assert res["frames"] == 10 * CFG.chunk and res["steps"] == 5
    assert res["max_dev"][0] < 1e-4 * max(1.0, res["max_abs"]), res["max_dev"]
    mels = res["mels"]
    assert (mels["utt0"][:50] - mels["utt1"][:50]).abs().max() > 1e-2  # different text, different speech
    return res


def test_streaming_tts_eager():
    torch.manual_seed(0)
    _check(Runner.bounded(CFG, block_size=16))


def test_streaming_tts_compiled_one_graph():
    from torch._dynamo.utils import counters

    torch.manual_seed(1)
    before = counters["stats"]["unique_graphs"]
    _check(Runner.bounded(CFG, compile=True, block_size=16))
    # requests joining and leaving, a read-only last chunk, padding rows: one graph throughout
    assert counters["stats"]["unique_graphs"] - before == 1


def test_voice_prompt_and_guidance_matter():
    """Host-only: the uncached model's output depends on the shared prompt and on the guidance weight."""
    torch.manual_seed(2)
    base = Runner.uncached(CFG)
    weights = base.model.state_dict()
    outs = []
    for cfg, lengths in ((CFG, [30, 17]), (CFG, [17, 30]), (TTSConfig(**{**CFG.__dict__, "guidance": 1.0}), [30, 17])):
        run = Runner.uncached(cfg, weights=weights)
        outs.append(stream(cfg, [run], make_prompts(cfg, lengths), make_utterances(cfg, [1], [0]))["mels"]["utt0"])
    assert (outs[0] - outs[1]).abs().max() > 1e-2
    assert (outs[0] - outs[2]).abs().max() > 1e-2


def test_flexkv_follows_the_pipelines_own_cache_rule():
    """Each request spoken alone with the pipeline's caches as it writes them (the chunk concatenated in
    front, `cache[:L] + cache[-100:]` past L + 100 frames) gives what the batched flexkv session gives;
    the mapping "the whole prompt as the sink + a window of 100" (`SinkWindow(L, 100)`) does not."""
    torch.manual_seed(3)
    bounded = Runner.bounded(CFG, block_size=16)
    prompts = make_prompts(CFG, [30, 17])
    utts = make_utterances(CFG, [5, 4, 3], [0, 0, 1], start_steps=[0, 1, 0])
    res = stream(CFG, [bounded], prompts, utts)
    assert pipeline_deviation(CFG, bounded.model, utts, res) < 1e-4 * max(1.0, res["max_abs"])

    literal = CFG.cache_config().replace(retention=lambda L: SinkWindow(L, 100))
    wrong = Runner(CFG, BoundedKVManager(literal, block_size=16), weights=bounded.model.state_dict())
    utts = make_utterances(CFG, [5, 4, 3], [0, 0, 1], start_steps=[0, 1, 0])
    res = stream(CFG, [wrong], prompts, utts)
    assert pipeline_deviation(CFG, wrong.model, utts, res) > 1e-2
