"""flexkv for Hugging Face transformers: a bounded sink + window cache for `generate()`.

`FlexKVCache(model, retention)` is a transformers `Cache` backed by a
`flexkv.GroupedKVManager` sized from the model's config: one group of
layers per kind of attention (and head size) the model has, each keeping
what that kind attends, plus the fixed-size state of any recurrent layers.
Building one installs forward hooks on the model (`enable(model)`); a
forward given a `FlexKVCache` as `cache` (or the older `past_key_values`)
is planned by the cache and runs its attention through the `"flexkv"`
function registered with transformers' `AttentionInterface`, one
FlexAttention call per layer. Every other forward runs exactly as it did
before the cache existed: the model's attention implementation is switched
to `"flexkv"` for the planned forward only. Llama, Mistral, Qwen2/3, Phi-3,
SmolLM3, Gemma 2/3/4, gpt-oss, GPT-2, DeepSeek-V2/V3, Qwen3-Next, Granite 4,
Falcon-H1 and the other models whose attention goes through that interface
need no code changes::

    from flexkv import SinkWindow
    from flexkv.integrations.transformers import FlexKVCache

    cache = FlexKVCache(model, SinkWindow(sink=4, window=1020), max_streams=8)
    out = model.generate(input_ids, attention_mask=mask, cache=cache,
                         max_new_tokens=100_000, do_sample=False)

What a stream keeps and attends
    Every batch row is one **stream** (a flexkv request) with its own slot.
    In a layer the model runs with full attention, the token at stream
    position `p` attends the stream positions `j <= p` with `j < sink` or
    `j >= p - window` (`retention`): StreamingLLM's attention sinks plus a
    sliding window, applied causally inside a prompt too. In a layer the
    model runs with its own sliding window `W` (`config.sliding_window`, per
    `config.layer_types`), the token attends exactly what the model attends,
    `p - W < j <= p`, and the slot keeps `W - 1` tokens
    (`sliding_retention` replaces that, e.g. to add sinks). A recurrent
    layer (linear attention, Mamba, short convolution) keeps its own state
    per stream, computed exactly as the model computes it. Padding columns
    (zeros in the 2-D `attention_mask`) are neither written nor attended;
    their outputs are zeros. Attention soft-capping (Gemma 2) and learned
    attention sinks (gpt-oss) are applied as the model applies them.

Positions
    The cache sets `position_ids` itself: a stream's tokens take positions
    0, 1, 2, ... in the order it wrote them, whatever padding or call they
    came in. `positions="stream"` rotates every key at that stream position
    (the model's own rotary embedding, unchanged). `positions="cache"` gives
    StreamingLLM's in-cache positions: distances to the sink entries are
    measured as if the evicted entries were never there (layers without
    rotary and layers without sinks are left as the model computes them).
    A model with learned absolute positions (GPT-2) cannot go past
    `max_position_embeddings`; a step that would is refused.

Streams across calls
    `cache.select(ids)` names the streams of the next forwards' rows; a new
    id starts an empty stream, a known id continues where it stopped. With no
    selection the first forward names its rows 0 .. batch-1.
    `get_seq_length()` counts the columns fed since the last selection, as
    `generate()` expects when it is handed back its own output.

Failed and interrupted forwards
    A forward's tokens (and recurrent states) are committed to the streams
    only when the forward returns. One that raises (in any layer) leaves
    every stream, the selection and `get_seq_length()` where they were, so
    it can be retried. One interrupted by a `KeyboardInterrupt` is undone
    as `generate()` unwinds, or else by the next forward of the model.

Compiling
    Compile `model.forward` (not the module: the hooks must stay outside the
    graph): `model.forward = torch.compile(model.forward, fullgraph=True)`.
    Decoding then runs one graph for every token; the plan of each step is an
    input of that graph.

Modules: `registration` (supported releases, the attention function),
`model_config` (what the config says about each layer), `plan` (one
planned forward), `shim` (transformers' `Cache` API), `recurrent`
(recurrent-layer states), `cache_positions` (`positions="cache"`),
`cache` (`FlexKVCache`), `hooks` (`enable`, `disable`).

Supported transformers releases: see `SUPPORTED_TRANSFORMERS`; any other
release fails at import with one message that says what to install.
"""

from .registration import ATTN_IMPLEMENTATION, SUPPORTED_TRANSFORMERS, flexkv_attention_forward  # noqa: I001
from .plan import FlexKVForward
from .hooks import disable, enable
from .cache import FlexKVCache

__all__ = [
    "ATTN_IMPLEMENTATION",
    "SUPPORTED_TRANSFORMERS",
    "FlexKVCache",
    "FlexKVForward",
    "disable",
    "enable",
    "flexkv_attention_forward",
]
