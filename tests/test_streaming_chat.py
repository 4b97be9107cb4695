"""The streaming chat decoder streamed through flexkv computes what it computes
without a bounded cache: every logit of every prompt and generated token."""

import torch

from examples.streaming_chat import ChatConfig, Runner, make_requests, stream
from single_thread import one_thread  # noqa: F401  (autouse: one torch thread per module)

CFG = ChatConfig(window=24, chunk=8, max_requests=3)


def _check(cfg, bounded, prompts, starts, max_new):
    uncached = Runner.uncached(cfg, weights=bounded.model.state_dict())
    reqs = make_requests(prompts, max_new, start_steps=starts, seed=3, vocab=cfg.vocab)
    res = stream(cfg, [bounded, uncached], reqs)
    assert res["max_len"] > 3 * cfg.window  # decoding went far past the window
    assert res["max_dev"][0] < 1e-4, res["max_dev"]
    # the run is not degenerate: logits differ between positions and the model generates varied tokens
    assert len({t for r in reqs for t in r.generated}) > 5
    return res


def test_chunked_prefill_and_decode_eager():
    torch.manual_seed(0)
    # a prompt of 2.5 windows, a short one, and one that joins while the others decode
    _check(CFG, Runner.bounded(CFG, block_size=16), [60, 13, 30], [0, 0, 9], 30)


def test_chunked_prefill_and_decode_compiled_two_graphs():
    from torch._dynamo.utils import counters

    torch.manual_seed(1)
    before = counters["stats"]["unique_graphs"]
    bounded = Runner.bounded(CFG, compile=True, block_size=16)
    _check(CFG, bounded, [60, 13, 30], [0, 0, 9], 30)
    # one graph for chunk steps, one for decode steps: no recompiles as streams advance and requests churn
    assert counters["stats"]["unique_graphs"] - before == 2


def test_streamingllm_cache_positions_eager():
    """rope_positions='cache': StreamingLLM's in-cache rotary positions, prompt fed one token per step."""
    torch.manual_seed(2)
    cfg = ChatConfig(window=16, chunk=8, max_requests=2, rope_positions="cache")
    bounded = Runner.bounded(cfg, block_size=16)
    _check(cfg, bounded, [10, 4], [0, 3], 45)
    # the same weights with stream positions compute something else once the sinks move
    other = Runner.uncached(ChatConfig(window=16, chunk=8, max_requests=2), weights=bounded.model.state_dict())
    cached = Runner.uncached(cfg, weights=bounded.model.state_dict())
    res = stream(cfg, [other, cached], make_requests([10], 40, seed=3, vocab=cfg.vocab))
    assert res["max_dev"][0] > 1e-3
