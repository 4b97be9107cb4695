"""The cache-aware streaming conformer streamed through flexkv computes what it
computes without a bounded cache, in both variants: chunks with look-ahead
(per-step window) and causal (per-query window)."""

import pytest
import torch

from examples.streaming_conformer import ConformerConfig, Runner, make_utterances, stream
from single_thread import one_thread  # noqa: F401  (autouse: one torch thread per module)

CFG = ConformerConfig(feats=16, dim=32, heads=4, layers=2, ffn=64, kernel=5, chunk=10, lookahead=4, window=70,
                      max_rel=40, max_requests=3)


def _check(cfg, bounded):
    uncached = Runner.uncached(cfg, weights=bounded.model.state_dict())
    utts = make_utterances(cfg, [16, 8, 5], start_steps=[0, 3, 9])
    res = stream(cfg, [bounded, uncached], utts)
    assert res["frames"] == 29 * cfg.chunk  # the first stream reaches 160 frames, past 2 windows
    assert res["max_dev"][0] < 1e-4, res["max_dev"]
    return res


@pytest.mark.parametrize("causal", [False, True])
def test_streaming_conformer_eager(causal):
    torch.manual_seed(0)
    cfg = ConformerConfig(**{**CFG.__dict__, "causal": causal})
    _check(cfg, Runner.bounded(cfg, block_size=16))


def test_streaming_conformer_compiled_one_graph():
    from torch._dynamo.utils import counters

    torch.manual_seed(1)
    before = counters["stats"]["unique_graphs"]
    _check(CFG, Runner.bounded(CFG, compile=True, block_size=16))
    assert counters["stats"]["unique_graphs"] - before == 1


def test_relative_bias_and_lookahead_matter():
    """Host-only: the bias table changes the output, and look-ahead frames reach the chunk (but not causally)."""
    torch.manual_seed(2)
    base = Runner.uncached(CFG)
    weights = base.model.state_dict()
    flat = {k: (torch.zeros_like(v) if k.endswith("rel_table") else v) for k, v in weights.items()}
    outs = [stream(CFG, [Runner.uncached(CFG, weights=w)], make_utterances(CFG, [9]))["outputs"]["utt0"]
            for w in (weights, flat)]
    assert (outs[0] - outs[1]).abs().max() > 1e-3
    # causal: frames already encoded do not change when later frames change
    causal = ConformerConfig(**{**CFG.__dict__, "causal": True})
    a, b = make_utterances(causal, [9]), make_utterances(causal, [9])
    b[0].feats[45:] += 1.0
    ya, yb = (stream(causal, [Runner.uncached(causal, weights=weights)], u)["outputs"]["utt0"] for u in (a, b))
    assert torch.equal(ya[:45], yb[:45]) and (ya[45:] - yb[45:]).abs().max() > 1e-3
