"""Quantized slots inside transformers: generate() against the uncached model reading the cells back.

A `FlexKVCache(model, ..., slot_dtype=...)` stores every key and value it is
given as 8-bit cells with a scale per cell and head, and nothing else about
the attention changes. So its greedy `generate()` must give, row by row, the
tokens and logits of the same model run without any cache over the whole
history (`hf_models.reference_greedy`) with one change: every key and value
its attention layers receive is replaced by what a quantized cell reads back
(`flexkv.cache.storage.quantized.round_trip`). The reference is the model's own
attention function (eager or SDPA, as the family runs it) behind that round
trip; recurrent layers run over the whole history unchanged.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import pytest
import torch

from hf_models import (
    CHUNK,
    LENGTHS,
    NEW,
    SINK,
    WINDOW,
    left_pad,
    logit_tolerance,
    make_model,
    prompts,
    reference_greedy,
)
from single_thread import one_thread  # noqa: F401

# hf_models above skips this module without the transformers extra: it imports before transformers, flexkv
# isort: split
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from flexkv import SinkWindow
from flexkv.cache.storage.quantized import round_trip
from flexkv.integrations.transformers import FlexKVCache
from flexkv.integrations.transformers.hooks import attention_configs

#: (family, slot dtype): softcapping and sliding layers (eager attention), learned sinks in float32
#: (eager), local and global layers (SDPA), keys wider than values (MLA), attention between
#: short-convolution layers (float64 throughout, so a rounding step cannot flip on a last-bit difference).
CASES = (
    ("gemma2", torch.int8),
    ("gpt_oss", torch.float8_e4m3fn),
    ("gemma3", torch.float8_e4m3fn),
    ("deepseek_v3", torch.int8),
    ("lfm2", torch.int8),
)


@contextmanager
def cells_read_back(model, slot_dtype):
    """Run `model`'s attention on what quantized cells read back for its keys and values."""
    name = f"round_trip_{str(slot_dtype).split('.')[-1]}"
    configs = attention_configs(model)
    saved = [cfg._attn_implementation_internal for cfg in configs]
    own = dict(zip(map(id, configs), saved))

    def attention(module, query, key, value, attention_mask, **kwargs):
        impl = own.get(id(module.config), saved[0])
        if impl == "eager":  # the model's own eager function (not a registered one)
            fn = sys.modules[type(module).__module__].eager_attention_forward
        else:
            fn = ALL_ATTENTION_FUNCTIONS[impl]
        return fn(module, query, round_trip(key, slot_dtype), round_trip(value, slot_dtype), attention_mask,
                  **kwargs)

    AttentionInterface.register(name, attention)
    # The masks (the model's own sliding ones included) are built as for the model's own attention.
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[saved[0]])
    try:
        for cfg in configs:
            cfg._attn_implementation_internal = name
        yield
    finally:
        for cfg, value in zip(configs, saved):
            cfg._attn_implementation_internal = value


@pytest.mark.parametrize("family, slot_dtype", CASES, ids=[f"{f}-{str(d).split('.')[-1]}" for f, d in CASES])
def test_generate_matches_the_model_reading_the_quantized_cells_back(family, slot_dtype):
    model = make_model(family)
    ps = prompts(LENGTHS)
    ids, mask = left_pad(ps)
    # Stream positions: the reference is the model's own attention, which reads every key at its stream index
    # (in-cache positions over quantized slots are checked against the float64 reference in test_quantized.py).
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=4, prefill_chunk=CHUNK, block_size=16,
                        slot_dtype=slot_dtype, rope_positions="stream")
    assert all(m.k_cache_0.dtype == slot_dtype for m in cache.manager.cache_groups)
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=NEW, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(out.logits, dim=1)
    tol = logit_tolerance(family, model.dtype)
    apart = 0.0
    for b, p in enumerate(ps):
        with cells_read_back(model, slot_dtype):
            want_tokens, want_logits = reference_greedy(model, p, NEW)
        assert out.sequences[b, ids.shape[1]:].tolist() == want_tokens.tolist(), f"{family} row {b}"
        torch.testing.assert_close(logits[b].double(), want_logits.double(), rtol=0, atol=tol)
        # The round trip is not the identity on these keys: an unquantized reference is further off.
        plain_tokens, plain_logits = reference_greedy(model, p, NEW)
        apart = max(apart, float((logits[b].double() - plain_logits.double()).abs().max()))
    assert apart > 10 * tol, f"{family}: the quantized cache is within {apart:.2g} of the unquantized model"


@pytest.mark.parametrize("slot_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "float8"])
def test_in_cache_positions_over_quantized_slots_differ_from_unquantized_as_stream_positions_do(slot_dtype):
    """Quantized slots keep `FlexKVCache`'s default in-cache positions. Over a stream 6x its window, fed in
    chunks whose queries evicted different counts (the sinks scored apart, their values read back from
    quantized cells), the logits stay as close to the unquantized cache's as quantization leaves stream
    positions: within twice that difference (exactness itself: tests/test_quantized.py)."""
    model = make_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 120), generator=torch.Generator().manual_seed(0))

    def logits(slot_dtype, rope):
        cache = FlexKVCache(model, SinkWindow(4, 16), max_streams=1, prefill_chunk=8, slot_dtype=slot_dtype,
                            rope_positions=rope)
        assert cache.rope_positions == ("cache" if rope is None else rope)
        with torch.no_grad():
            return torch.cat([model(ids[:, s:s + 8], cache=cache).logits for s in range(0, 120, 8)], 1)

    apart = {rope: float((logits(slot_dtype, rope) - logits(None, rope)).abs().max()) for rope in ("stream", None)}
    assert 0 < apart[None] <= 2 * apart["stream"], apart
