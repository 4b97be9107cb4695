"""`FlexKVCache(model, Recall(...))` in transformers' `generate()`, eager and compiled.

- Exact where the answer is known without flexkv: a memory that holds the whole history with every
  block attended, read at stream positions, is full attention, so greedy ids equal `DynamicCache`'s.
- The memory is read: a memory too small to hold everything, attending 2 of its blocks, gives ids
  that differ from both full attention and sinks + window alone.
- Compiled (`compile_config`) over a padded batch and a second `generate()` on the same cache: the ids
  equal the eager cache's and no decode step compiles again as the memories fill.
"""

from __future__ import annotations

import pytest
import torch

from hf_models import left_pad, make_model, prompts
from single_thread import one_thread  # noqa: F401

# hf_models above skips this module without the transformers extra: it imports before transformers, flexkv
# isort: split

from transformers import DynamicCache

from flexkv import Recall, SinkWindow
from flexkv.integrations.transformers import FlexKVCache

KW = dict(max_streams=2, prefill_chunk=8)
NEW = 40


@pytest.fixture(scope="module")
def llama():
    return make_model("llama", dtype=torch.float32, seed=3)


def _generate(model, cache, ids, mask, new=NEW, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=new, do_sample=False, **kw)


def test_a_memory_of_the_whole_history_with_every_block_read_is_full_attention(llama):
    ids, mask = left_pad(prompts((22, 13), seed=4))
    want = _generate(llama, DynamicCache(), ids, mask)
    everything = Recall(4, 8, memory=64, block=4, top_k=16)  # holds all 62 tokens, attends all of it
    got = _generate(llama, FlexKVCache(llama, everything, rope_positions="stream", **KW), ids, mask)
    assert torch.equal(got, want)


def test_a_bounded_memory_is_read_and_is_not_full_attention(llama):
    ids, mask = left_pad(prompts((22, 13), seed=4))
    full = _generate(llama, DynamicCache(), ids, mask)
    window = _generate(llama, FlexKVCache(llama, SinkWindow(4, 8), **KW), ids, mask)
    cache = FlexKVCache(llama, Recall(4, 8, memory=16, block=4, top_k=2), **KW)
    recall = _generate(llama, cache, ids, mask)
    assert not torch.equal(recall, window) and not torch.equal(recall, full)
    assert "Recall(sink=4, window=8, memory=16, block=4, top_k=2)" in repr(cache)


def test_compiled_generate_equals_eager_and_decodes_on_one_graph(llama):
    from transformers import CompileConfig

    retention = Recall(4, 8, memory=16, block=4, top_k=2)
    ids, mask = left_pad(prompts((9, 5), seed=4))
    more = torch.stack(prompts((3, 3), seed=5))

    def chat(**kw):
        cache = FlexKVCache(llama, retention, **KW)
        first = _generate(llama, cache, ids, mask, **kw)
        seq = torch.cat([first, more], dim=1)
        mask2 = torch.cat([mask, torch.ones(2, seq.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
        return first, _generate(llama, cache, seq, mask2, **kw)

    want = chat()
    counters = torch._dynamo.utils.counters
    graphs = []

    @torch.compiler.disable
    def count(mod, args, kwargs, out):
        if kwargs["input_ids"].shape[1] == 1:
            graphs.append(counters["stats"]["unique_graphs"])

    config = CompileConfig(fullgraph=False)
    config._compile_all_devices = True
    counters.clear()
    hook = llama.register_forward_hook(count, with_kwargs=True)
    try:
        got = chat(compile_config=config)
    finally:
        hook.remove()
        llama.__dict__.pop("_compiled_call", None)
    assert [torch.equal(g, w) for g, w in zip(got, want)] == [True, True]
    assert graphs[2] >= 1 and graphs[2:] == [graphs[2]] * (len(graphs) - 2), f"decode steps compiled again: {graphs}"
