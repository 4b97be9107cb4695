"""Compiled `generate()` through a FlexKVCache, both ways transformers users write it.

- transformers' own switch: `generate(..., compile_config=CompileConfig(...))` compiles the model's
  `__call__` for decoding (prefill stays eager); FlexKVCache says it is compileable, flexkv's hooks
  plan outside the graph, and the 2-D padding mask reaches them.
- `model.forward = torch.compile(model.forward, dynamic=None)`: torch's default automatic dynamic
  shapes, whose recompile after the prefill made every plan size a symbol (torch 2.13 failed with
  `InternalTorchDynamoError: KeyError` inside the shared FlexAttention region); a flexkv forward
  now compiles with static shapes.

Each runs a batch of two rows of different lengths (left padding) far past the ring's length, then
a second `generate()` that continues both chats; the greedy ids equal the eager cache's, and no
decode step after the first compiles a graph.
"""

from __future__ import annotations

import pytest
import torch
from compile_guards import refuse_while_compiling
from torch._dynamo.testing import CompileCounter

from hf_models import left_pad, make_model, prompts
from single_thread import one_thread  # noqa: F401

# hf_models above skips this module without the transformers extra: it imports before transformers, flexkv
# isort: split

from flexkv import SinkWindow
from flexkv.integrations.transformers import FlexKVCache

RETENTION = SinkWindow(4, 12)
NEW = 48  # new tokens per call: the 4 + 12 retention's ring wraps several times in each call
KW = dict(max_streams=4, prefill_chunk=16)


def _chat(model, **generate_kw):
    """Two `generate()` calls on one cache: a padded batch of two prompts, then both chats continued with
    three more tokens each. Returns both outputs and, for each decode forward (one token per row), the
    count of graphs compiled so far."""
    counters = torch._dynamo.utils.counters
    graphs = []

    @torch.compiler.disable  # transformers' compile_config compiles `__call__`, hooks included: count outside it
    def count(mod, args, kwargs, out):
        if kwargs["input_ids"].shape[1] == 1:
            graphs.append(counters["stats"]["unique_graphs"])

    hook = model.register_forward_hook(count, with_kwargs=True)
    ids, mask = left_pad(prompts((9, 5), seed=4))
    more = prompts((3, 3), seed=5)
    cache = FlexKVCache(model, RETENTION, **KW)
    try:
        with torch.no_grad():
            first = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=NEW, do_sample=False,
                                   **generate_kw)
            seq = torch.cat([first, torch.stack(more)], dim=1)
            mask2 = torch.cat([mask, torch.ones(2, seq.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
            second = model.generate(seq, attention_mask=mask2, cache=cache, max_new_tokens=NEW, do_sample=False,
                                    **generate_kw)
    finally:
        hook.remove()
    return (first, second), graphs


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles the one model's forward its own way: dynamo's graphs for it start empty, so
    that the other tests' graphs neither count nor fill its recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def llama():
    model = make_model("llama", dtype=torch.float32, seed=3)
    want, _ = _chat(model)
    return model, want


def test_generate_with_transformers_compile_config_compiles_decoding_once(llama):
    """transformers' own switch for a compileable cache (`compile_config`; on the CPU it must be asked
    for with `_compile_all_devices`): same greedy ids as eager, one decode graph for both calls."""
    from transformers import CompileConfig

    model, want = llama
    assert FlexKVCache(model, RETENTION, **KW).is_compileable
    config = CompileConfig(fullgraph=False)
    config._compile_all_devices = True
    torch._dynamo.utils.counters.clear()
    try:
        got, graphs = _chat(model, compile_config=config)
    finally:
        model.__dict__.pop("_compiled_call", None)
    assert [torch.equal(g, w) for g, w in zip(got, want)] == [True, True]
    # Read after each decode forward, the count lags one forward behind: it holds from the third on.
    assert len(graphs) >= 2 * (NEW - 1) and graphs[2] >= 1
    assert graphs[2:] == [graphs[2]] * (len(graphs) - 2), f"decode steps compiled again: {graphs}"

def test_compile_config_with_fullgraph_is_refused_before_anything_runs(llama):
    """`CompileConfig(fullgraph=True)` compiles `__call__`, flexkv's host-side planning hooks inside it: refused
    with the two ways that work, before any forward (the cache holds no stream after)."""
    from transformers import CompileConfig

    model, _ = llama
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True
    cache = FlexKVCache(model, RETENTION, **KW)
    ids = torch.stack(prompts((6,), seed=9))
    with pytest.raises(ValueError, match=r"CompileConfig\(fullgraph=True\).*fullgraph=False.*model.forward = torch"):
        model.generate(ids, cache=cache, max_new_tokens=2, do_sample=False, compile_config=config)
    assert list(cache.streams) == [] and "_compiled_call" not in model.__dict__


def test_a_forward_compiled_with_dynamic_none_decodes_on_one_graph(llama):
    """`torch.compile(model.forward, dynamic=None)` (torch's default): the prefill's graph, then the
    first decode step's, and no other decode step compiles; the ids are the eager cache's. The graphs
    are traced by dynamo alone (`backend="eager"`), where the automatic-dynamic failure lay."""
    model, want = llama
    forward = model.forward
    torch._dynamo.utils.counters.clear()
    model.forward = torch.compile(forward, backend="eager", dynamic=None)
    try:
        got, graphs = _chat(model)
    finally:
        model.forward = forward
    assert [torch.equal(g, w) for g, w in zip(got, want)] == [True, True]
    # Read after each decode forward, the count lags one forward behind: it holds from the third on,
    # but for one graph, the second call's prefill (a new length).
    first, second = graphs[2:NEW - 1], graphs[NEW + 1:]
    assert first[0] >= 2 and first == [first[0]] * len(first), f"decode steps compiled again: {graphs}"
    assert second == [second[0]] * len(second) and second[0] <= first[0] + 1, graphs
    assert torch._dynamo.config.automatic_dynamic_shapes  # restored after each forward


def test_a_forward_compiled_by_hand_runs_its_chunks_on_one_graph(llama, monkeypatch):
    """`model.forward = torch.compile(model.forward)` and a prompt of three 16-token chunks, no padding:
    the hooks run the compiled forward once per chunk (one graph for all three, not a graph holding
    every chunk of every layer), the streams advance only when the last chunk returns, and the ids
    equal the eager cache's, the prompt and the chat continued after it. A second cache on the same
    compiled forward compiles nothing more. What the sink rotation's layers share (the chunks past the
    window attend per query) comes with each plan: formed while tracing, it fails the compile here."""
    from flexkv.cache.positions.rotary import SinkRotation

    refuse_while_compiling(monkeypatch, SinkRotation, ("_sink_geometry", "_sink_turn", "_entry_cells", "_query_sinks", "_query_turn"), "compiled forward")
    model, _ = llama
    ids = torch.stack(prompts((48, 48), seed=6))
    more = torch.stack(prompts((5, 5), seed=7))

    def chat():
        cache = FlexKVCache(model, RETENTION, **KW)
        with torch.no_grad():
            first = model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False)
            second = model.generate(torch.cat([first, more], dim=1), cache=cache, max_new_tokens=6, do_sample=False)
        return first, second, cache

    want = chat()[:2]
    forward = model.forward
    torch._dynamo.utils.counters.clear()
    counter = CompileCounter()
    seen = []  # after each model call: the columns its forward ran, the graphs compiled so far

    def count(mod, args, kwargs, out):
        seen.append((kwargs["input_ids"].shape[1], counter.frame_count))

    hook = model.register_forward_hook(count, with_kwargs=True)
    model.forward = torch.compile(forward, backend=counter, fullgraph=True)
    try:
        first, second, cache = chat()
        graphs = counter.frame_count
        again = chat()  # a new cache on the same compiled forward
    finally:
        model.forward = forward
        hook.remove()
    assert torch.equal(first, want[0]) and torch.equal(second, want[1])
    assert torch.equal(again[0], first) and torch.equal(again[1], second)
    assert counter.frame_count == graphs, "a new cache compiled the forward again"
    seen = seen[:len(seen) // 2]
    # The cache's one-token routing probe runs eager; the prompt's forward ends on its last 16-column
    # chunk with one graph compiled for all three; decoding compiles one more; the second call's prompt
    # (the last answer token and 5 more: one chunk) a third, and its decoding none.
    assert seen == [(1, 0), (16, 1)] + [(1, 2)] * 5 + [(6, 3)] + [(1, 3)] * 5, seen
    assert [cache.stream_length(s) for s in cache.streams] == [first.shape[1] + 5 + 5] * 2


def test_a_forward_compiled_by_hand_returns_every_chunks_logits(llama):
    """A plain forward of three chunks (`logits_to_keep` 0: every column's logits) through a forward
    compiled by hand: its logits are the eager cache's, all 40 columns of them, in order."""
    model, _ = llama
    ids = torch.stack(prompts((40,), seed=8))
    with torch.no_grad():
        want = model(input_ids=ids, cache=FlexKVCache(model, RETENTION, **KW)).logits
        forward = model.forward
        model.forward = torch.compile(forward, backend="eager", fullgraph=True)
        try:
            got = model(input_ids=ids, cache=FlexKVCache(model, RETENTION, **KW)).logits
        finally:
            model.forward = forward
    assert got.shape == want.shape == (1, 40, want.shape[-1])
    # Each chunk rotates its queries one by one (one graph for every chunk) where the eager forward rotates
    # a chunk's at once: the same arithmetic in another order, float32 rounding apart.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("where", ["second chunk", "last chunk"])
def test_a_chunk_that_fails_takes_the_whole_forward_back(llama, monkeypatch, where):
    """The chunks of a forward compiled by hand are one forward: when the second of three chunks fails
    (an error), or Ctrl-C arrives as the last one returns (before the chunks' outputs are joined), no
    chunk's tokens are in the stream, and the same cache then serves the prompt as if nothing had happened
    (the ids equal a fresh cache's)."""
    from flexkv.integrations.transformers import hooks
    from flexkv.model.attendance import AttendanceRecord

    model, _ = llama
    ids = torch.stack(prompts((40,), seed=9))
    with torch.no_grad():
        want = model.generate(ids, cache=FlexKVCache(model, RETENTION, **KW), max_new_tokens=4, do_sample=False)
    settle, join = AttendanceRecord.settle, hooks.join_outputs
    calls = []

    def failing_settle(record):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the second chunk failed")
        settle(record)

    def interrupted_join(earlier, result):
        calls.append(len(earlier))
        raise KeyboardInterrupt

    cache = FlexKVCache(model, RETENTION, **KW)
    forward = model.forward
    model.forward = torch.compile(forward, backend="eager", fullgraph=True)
    try:
        if where == "second chunk":
            monkeypatch.setattr(AttendanceRecord, "settle", failing_settle)
            raised = pytest.raises(RuntimeError, match="second chunk failed")
        else:
            monkeypatch.setattr(hooks, "join_outputs", interrupted_join)
            raised = pytest.raises(KeyboardInterrupt)
        with torch.no_grad(), raised:
            model(input_ids=ids, cache=cache)
        assert [cache.stream_length(s) for s in cache.streams] in ([], [0]) and cache.get_seq_length() == 0
        monkeypatch.setattr(AttendanceRecord, "settle", settle)
        monkeypatch.setattr(hooks, "join_outputs", join)
        with torch.no_grad():
            got = model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False)
    finally:
        model.forward = forward
    # Three chunks of 16, 16 and 8: the error at the second; the interrupt after all three ran.
    assert calls == ([1, 1] if where == "second chunk" else [2]) and torch.equal(got, want)
