"""`flexkv.swap_attention`, and the worked port of a model with its own ring cache
(`examples/ring_transformer.py` through `examples/port_ring_transformer.py`).

The port is checked against the model's own streaming (its ring caches) for
chunks and single frames, eager and compiled (no recompile after warm-up),
and against the uncached twin.
"""

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from examples.port_ring_transformer import (
    OwnStreaming,
    Port,
    attention_with_model_rope,
    max_deviation,
    schedule,
    stream_all,
)
from examples.ring_transformer import StreamingAttention, StreamingTransformer, TransformerArgs
from flexkv import BoundedKVConfig, SinkWindow, StreamSession, swap_attention
from flexkv.model.wrap import CacheAttention
from single_thread import one_thread  # noqa: F401  (autouse: one torch thread per module)

ARGS = TransformerArgs(d_in=8, d_model=32, num_heads=2, num_layers=2, dim_feedforward=48, context=10, d_out=8)
STREAMS, CHUNK = 2, 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return StreamingTransformer(ARGS).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def steps():
    # 6 chunks of 4 frames (2.4x the context: the ring has wrapped), then 6 single frames
    return schedule(ARGS, STREAMS, CHUNK, chunks=6, frames=6)


@pytest.fixture(scope="module")
def own(model, steps):
    return stream_all(OwnStreaming(model, STREAMS), steps)


def _context(layers=ARGS.num_layers):
    cfg = BoundedKVConfig(num_layers=layers, num_heads=2, head_dim=16, rows_per_request=1, max_source_len=0,
                          max_sources=0, retention=SinkWindow.keys(10), causal_step=True, max_slots=2,
                          max_step_tokens=CHUNK)
    return StreamSession(cfg, compile=False).context


def test_swap_keeps_the_model_and_restore_gives_its_forward_back(model):
    m = StreamingTransformer(ARGS)
    m.load_state_dict(model.state_dict())
    keys, names = list(m.state_dict()), [n for n, _ in m.named_modules()]
    x = torch.randn(1, 3, ARGS.d_in)
    before = m(x)
    swap = swap_attention(m, _context(), StreamingAttention, attention_with_model_rope)
    assert swap.names == ("layers.0.self_attn", "layers.1.self_attn")
    assert [c.layer_idx for c in swap.cores] == [0, 1] and swap.layer_of(m.layers[1].self_attn) == 1
    assert list(m.state_dict()) == keys and [n for n, _ in m.named_modules()] == names
    assert all(isinstance(c, CacheAttention) for c in swap.cores)
    with pytest.raises(ValueError, match="layers.0.self_attn is swapped already; restore"):
        swap_attention(m, _context(), StreamingAttention, attention_with_model_rope)
    swap.restore()
    swap.restore()  # a second restore does nothing
    assert "forward" not in m.layers[0].self_attn.__dict__
    torch.testing.assert_close(m(x), before, rtol=0, atol=0)
    with swap_attention(m, _context(), lambda name, mod: name.endswith("self_attn"), attention_with_model_rope) as s:
        assert len(s) == 2
    assert "forward" not in m.layers[1].self_attn.__dict__


def test_swap_refuses_what_does_not_fit_and_swaps_nothing():
    m = StreamingTransformer(ARGS)
    with pytest.raises(ValueError, match=r"2 modules match .* but the cache has num_layers=3"):
        swap_attention(m, _context(layers=3), StreamingAttention, attention_with_model_rope)
    with pytest.raises(ValueError, match="0 modules match .*none"):
        swap_attention(m, _context(), nn.Conv1d, attention_with_model_rope)
    with pytest.raises(ValueError, match="match must be an nn.Module class, a tuple of classes or a predicate"):
        swap_attention(m, _context(), "self_attn", attention_with_model_rope)
    with pytest.raises(ValueError, match="context must be a flexkv.model.step_context.StepContext"):
        swap_attention(m, object(), StreamingAttention, attention_with_model_rope)
    with pytest.raises(ValueError, match="give core or attention options"):
        swap_attention(m, _context(), StreamingAttention, attention_with_model_rope,
                       core=lambda i, mod: None, scale=1.0)
    ctx = _context()
    with pytest.raises(ValueError, match=r"core\(1, module\) must return a CacheAttention of layer 1"):
        swap_attention(m, ctx, StreamingAttention, attention_with_model_rope, core=lambda i, mod: CacheAttention(ctx, 0))
    assert all("forward" not in layer.self_attn.__dict__ for layer in m.layers)


@pytest.mark.parametrize("variant", ["model-rope", "flexkv-rope", "uncached"])
def test_eager_port_matches_the_models_own_streaming(model, steps, own, variant):
    port = Port(model, STREAMS, CHUNK, rope="flexkv" if variant == "flexkv-rope" else "model",
                uncached=variant == "uncached")
    assert max_deviation(stream_all(port, steps), own) < 1e-5


def test_literal_context_mapping_is_off(model, steps, own):
    """`SinkWindow(0, context)` with whole-chunk attention reads keys the model's ring does not hold."""
    assert max_deviation(stream_all(Port(model, STREAMS, CHUNK, literal=True), steps), own) > 1e-2


def test_compiled_port_matches_without_recompiling(model, steps, own):
    torch._dynamo.reset()
    counters.clear()
    port = Port(model, STREAMS, CHUNK, compile=True)
    port.session.warmup(port._forward, steps[0]["s0"])
    assert counters["stats"]["unique_graphs"] == 2  # chunks of 4 frames, single frames
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = stream_all(port, steps)
    assert counters["stats"]["unique_graphs"] == 2
    assert max_deviation(got, own) < 1e-4
