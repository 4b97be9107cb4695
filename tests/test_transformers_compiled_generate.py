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
