"""flexkv for Hugging Face transformers: a bounded sink + window cache for `generate()`.

`FlexKVCache(model, retention)` is a transformers `Cache` backed by a
`flexkv.BoundedKVManager` sized from the model's config (a layer group per
kind of layer); every batch row is
one stream. A forward given it as `cache=` is planned by forward hooks and
runs its attention through the `"flexkv"` function registered with
transformers' `AttentionInterface`; every other forward runs the model's
own attention::

    from flexkv import SinkWindow
    from flexkv.integrations.transformers import FlexKVCache

    cache = FlexKVCache(model, SinkWindow(sink=4, window=1020), max_streams=8)
    out = model.generate(input_ids, attention_mask=mask, cache=cache, max_new_tokens=100_000)

docs/transformers.md is the full description: what each layer keeps and
attends, positions, batches and padding, streams across calls, failed and
interrupted forwards, compiling, what is refused, and every model family
tried.

Modules: `registration` (supported releases, the attention function),
`model_config` (what the config says about each layer), `model_survey`
(what a cache reads from its model and the checks that refuse one), `plan` (one
planned forward), `shim` (transformers' `Cache` API), `recurrent`
(recurrent-layer states), `cache_positions` (`rope_positions="cache"`),
`routing` (the one-token probe that the plan reaches every attention layer),
`selection` (which stream each batch row is, the columns fed, the tokens
owed), `turns` (the token `generate()` returned last, across calls), `cache`
(`FlexKVCache`), `branching` (beam search, assisted generation and many
samples: forks and rollbacks of streams), `hooks` (`enable`, `disable`).

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
