"""flexkv for Hugging Face transformers: a bounded sink + window cache for `generate()`.

`FlexKVCache(model, retention)` is a transformers `Cache` backed by a
`flexkv.GroupedKVManager` sized from the model's config: one group of
layers per kind of attention the model has, each keeping what that kind
attends. Building one installs forward hooks on the model (`enable(model)`);
a forward given a `FlexKVCache` as `past_key_values` (or `cache`) is planned
by the cache and runs its attention through the `"flexkv"` function
registered with transformers' `AttentionInterface`, one FlexAttention call
per layer. Every other forward runs exactly as it did before the cache
existed: the model's attention implementation is switched to `"flexkv"` for
the planned forward only. Llama, Mistral, Qwen2/3, Phi-3, SmolLM3, Gemma 2/3,
gpt-oss, GPT-2 and the other models that route their attention through that
interface need no code changes::

    from flexkv import SinkWindow
    from flexkv.integrations.transformers import FlexKVCache

    cache = FlexKVCache(model, SinkWindow(sink=4, window=1020), max_streams=8)
    out = model.generate(input_ids, attention_mask=mask, past_key_values=cache,
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
    (`sliding_retention` replaces that, e.g. to add sinks). Padding columns
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

Failed forwards
    A forward's tokens are committed to the streams only when the forward
    returns. One that raises (in any layer) leaves every stream, the
    selection and `get_seq_length()` where they were, so it can be retried.

Compiling
    Compile `model.forward` (not the module: the hooks must stay outside the
    graph): `model.forward = torch.compile(model.forward, fullgraph=True)`.
    Decoding then runs one graph for every token; the plan of each step is an
    input of that graph.

Supported transformers releases: see `SUPPORTED_TRANSFORMERS`; any other
release fails at import with one message that says what to install.
"""

from __future__ import annotations

import re
from typing import Hashable, List, Optional, Sequence

import torch

from ..config import BoundedKVConfig, SinkWindow
from ..groups import GroupedKVManager, GroupedPlan, LayerGroup
from ..step import BoundedKVStep, Segment, StreamPosition

__all__ = [
    "ATTN_IMPLEMENTATION",
    "SUPPORTED_TRANSFORMERS",
    "FlexKVCache",
    "FlexKVForward",
    "disable",
    "enable",
    "flexkv_attention_forward",
]

#: The transformers releases this module is tested with: `>= lo, < hi`.
SUPPORTED_TRANSFORMERS = ("5.23", "5.25")
#: The name the attention function is registered under.
ATTN_IMPLEMENTATION = "flexkv"
POSITION_MODES = ("stream", "cache")
#: The layer types (`config.layer_types`) flexkv serves.
LAYER_TYPES = ("full_attention", "sliding_attention")


def _version_tuple(text: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:2])


def _import_transformers():
    """Import transformers, or fail with one message naming the supported range."""
    lo, hi = SUPPORTED_TRANSFORMERS
    hint = (
        f"flexkv.integrations.transformers needs transformers>={lo},<{hi}; "
        f"install it with: pip install 'flexkv[transformers]'"
    )
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(f"{hint} (transformers is not installed)") from exc
    found = transformers.__version__
    if not _version_tuple(lo) <= _version_tuple(found) < _version_tuple(hi):
        raise ImportError(f"{hint} (found transformers {found})")
    return transformers


_import_transformers()

from transformers import AttentionInterface  # noqa: E402
from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402


# ----------------------------------------------------------------- attention


def flexkv_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    flexkv_step: Optional["FlexKVForward"] = None,
    **kwargs,
):
    """The `"flexkv"` attention function (transformers' `AttentionInterface` signature).

    `query [B, Hq, T, D]`, `key`/`value [B, Hkv, T, D]` (the step's own
    tokens, already rotated). Returns `([B, T, Hq, D], None)`. The model
    passes `softcap` (Gemma 2), `s_aux` (gpt-oss's learned sinks) and its
    layer's `sliding_window`; all three are honoured. It runs only inside a
    forward planned by a `FlexKVCache`, which switches the model to it for
    that forward.
    """
    if flexkv_step is None:
        raise ValueError(
            f"the {ATTN_IMPLEMENTATION!r} attention ran in a forward no FlexKVCache planned "
            f"({type(module).__name__}, layer {getattr(module, 'layer_idx', None)}): a FlexKVCache switches the model "
            f"to it for the forwards it plans and back afterwards; do not set attn_implementation="
            f"{ATTN_IMPLEMENTATION!r} yourself, and after cache.prepare() call cache.commit() or cache.rollback()"
        )
    if module.training and dropout > 0:
        raise ValueError(
            f"flexkv attention is for inference: got dropout={dropout} in training mode; call model.eval()"
        )
    out = flexkv_step.attend(
        module.layer_idx, query, key, value, scaling,
        softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"), sliding_window=kwargs.get("sliding_window"),
    )
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, flexkv_attention_forward)
    # The mask transformers builds inside a planned forward is not read (flexkv masks itself);
    # SDPA's mask function builds a valid one for any model.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


_SOFTCAP_MODS: dict = {}


def _softcap_mod(cap: float):
    """`score_mod` capping a scaled score at `cap` as Gemma 2 does: `cap * tanh(score / cap)`."""
    cap = float(cap)
    mod = _SOFTCAP_MODS.get(cap)
    if mod is None:

        def mod(score, b, h, q_pos, kv_pos):
            return torch.tanh(score / cap) * cap

        _SOFTCAP_MODS[cap] = mod
    return mod


# -------------------------------------------------------------- per forward


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`x[b, :, index[b, t], :]` for `x [B, H, T, D]`, `index [B, T']` -> `[B, H, T', D]`."""
    B, H, _, D = x.shape
    return x.gather(2, index[:, None, :, None].expand(B, H, index.shape[1], D))


class FlexKVForward:
    """One planned forward pass: the plan of each chunk and how columns map to stream tokens.

    Made by `FlexKVCache.prepare` on the host and handed to every layer
    through the forward's `flexkv_step` keyword. Its tensors are on the
    cache's device; `attend` reads nothing but tensors, so a compiled forward
    sees a new `FlexKVForward` every step without recompiling.
    """

    def __init__(self, cache: "FlexKVCache", steps, plans, gather, scatter, position_ids):
        self.cache = cache
        self.manager = cache.manager
        #: the flexkv steps of the forward's chunks, committed when the forward returns
        self.steps = tuple(steps)
        #: one `GroupedPlan` per chunk
        self.plans = tuple(plans)
        #: `[B, T']` column of each stream token (None: every column is a token)
        self.gather = gather
        #: `[B, T]` index into the `T' + 1` outputs for each column (`T'`: zeros)
        self.scatter = scatter
        #: `[B, T]` the stream position of each column
        self.position_ids = position_ids
        #: "cache" positions: re-rotates the step's q/k and rewrites the sink cells per layer
        self.rotary = cache._rotary
        #: the model module whose hooks planned the forward (None: planned by hand)
        self.owner = None

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale=None,
        *,
        softcap: Optional[float] = None,
        sinks: Optional[torch.Tensor] = None,
        sliding_window: Optional[int] = None,
    ) -> torch.Tensor:
        """Attend layer `layer_idx` for the whole forward: `[B, Hq, T, D]` in, `[B, Hq, T, D]` out."""
        self.cache._check_layer(layer_idx, sliding_window, softcap)
        score_mod = None if softcap is None else _softcap_mod(softcap)
        if self.gather is not None:
            q, k, v = _take(q, self.gather), _take(k, self.gather), _take(v, self.gather)
        outs = []
        start = 0
        single = len(self.plans) == 1 and self.plans[0].tokens == q.shape[2]
        for plan in self.plans:
            if single:
                qc, kc, vc = q, k, v
            else:
                stop = start + plan.tokens
                qc, kc, vc = q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop]
                start = stop
            if self.rotary is not None:
                qc, kc = self.rotary(layer_idx, qc, kc, plan)
            outs.append(self.manager.attend(layer_idx, qc, kc, vc, plan, scale=scale, score_mod=score_mod, sinks=sinks))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        if self.scatter is not None:
            out = _take(torch.cat([out, out.new_zeros(out.shape[0], out.shape[1], 1, out.shape[3])], dim=2), self.scatter)
        return out


class _Pending:
    """A planned forward not yet committed, and what to restore if it fails."""

    def __init__(self, forward: FlexKVForward, new_streams, columns: int, selection):
        self.forward = forward
        self.new_streams = tuple(new_streams)
        self.columns = columns
        self.selection = selection


# -------------------------------------------------------------------- cache


class _FlexKVLayer(CacheLayerMixin):
    """Per-layer view transformers' `Cache` bookkeeping expects; the data lives in the manager."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, owner: "FlexKVCache"):
        super().__init__()
        self.owner = owner
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple:
        return query_length, 0

    def get_seq_length(self) -> int:
        return self.owner._columns

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        pass

    def reorder_cache(self, beam_idx) -> None:
        self.owner._unsupported("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        self.owner._unsupported("crop (assisted or speculative decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.owner._unsupported("batch_repeat_interleave (num_return_sequences > 1)")

    def batch_select_indices(self, indices) -> None:
        self.owner._unsupported("batch_select_indices")


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _model_dims(config) -> dict:
    cfg = _text_config(config)
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
    layers = getattr(cfg, "num_hidden_layers", None)
    for name, val in (("num_hidden_layers", layers), ("num_attention_heads", heads), ("head_dim", head_dim)):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"model config has no usable {name} (got {val!r}); FlexKVCache needs a decoder-only LM config")
    return dict(cfg=cfg, layers=layers, kv_heads=kv_heads, head_dim=head_dim)


def _layer_windows(cfg, layers: int) -> List[Optional[int]]:
    """The model's own sliding window of each layer (None: full attention), as its masks apply them.

    With `config.layer_types`, layers typed `"sliding_attention"` attend the
    last `config.sliding_window` tokens (themselves included) and
    `"full_attention"` layers everything. Without it, every layer slides when
    `config.sliding_window` is set (Mistral, Phi-3), none otherwise.
    """
    sw = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        if sw is None or getattr(cfg, "use_sliding_window", True) is False:
            return [None] * layers
        types = ["sliding_attention"] * layers
    types = list(types)
    if len(types) < layers:
        raise ValueError(f"config.layer_types names {len(types)} layers but the model has {layers}")
    out = []
    for i, t in enumerate(types[:layers]):
        if t not in LAYER_TYPES:
            raise ValueError(
                f"layer {i} is of type {t!r}; FlexKVCache serves the layer types {LAYER_TYPES} only"
            )
        if t == "full_attention":
            out.append(None)
            continue
        if isinstance(sw, bool) or not isinstance(sw, int) or sw < 1:
            raise ValueError(
                f"layer {i} is a sliding_attention layer but config.sliding_window={sw!r} is not a positive int"
            )
        out.append(sw)
    return out


def _absolute_positions(model, cfg) -> Optional[tuple]:
    """`(limit, module name)` for a model with learned absolute position embeddings, else None."""
    base = getattr(model, "base_model", model)
    if getattr(base, "rotary_emb", None) is not None:
        return None
    for name in ("wpe", "embed_positions", "position_embeddings"):
        emb = getattr(base, name, None)
        if isinstance(emb, torch.nn.Embedding):
            limit = getattr(cfg, "max_position_embeddings", None)
            if not isinstance(limit, int) or limit < 1:
                limit = emb.num_embeddings
            return min(limit, emb.num_embeddings), name
    return None


def _softcap_of(cfg) -> Optional[float]:
    cap = getattr(cfg, "attn_logit_softcapping", None)
    return None if cap is None else float(cap)


def _check_retention(name: str, value) -> None:
    if not isinstance(value, SinkWindow):
        raise ValueError(f"{name} must be a flexkv.SinkWindow(sink, window), got {value!r}")
    if value.window_includes_step:
        raise ValueError(
            f"{name} {value} has window_includes_step=True; a language model's tokens attend "
            f"themselves on top of the window: use SinkWindow(sink, window) (window_includes_step=False)"
        )


class FlexKVCache(Cache):
    """A bounded KV cache for a transformers causal LM, one stream per batch row.

    Args:
        model: a `PreTrainedModel` whose attention goes through transformers'
            `AttentionInterface`. Its layers, layer types, sliding window, KV
            heads, head dim, dtype and device size the cache; hooks are
            installed on it (see `enable`).
        retention: `SinkWindow(sink, window)` for the model's full-attention
            layers: each stream keeps its first `sink` and its last `window`
            tokens there, and each token attends those plus itself.
        sliding_retention: what the model's sliding-window layers keep.
            None (default): exactly the model's window (`SinkWindow(0,
            sliding_window - 1)`). A `SinkWindow` replaces it (e.g. to add
            sinks); its window may not exceed the model's.
        max_streams: streams the cache holds at once (slots); memory is
            allocated for all of them up front.
        positions: `"stream"` or `"cache"` (see the module docstring).
        prefill_chunk: the most tokens per row one flexkv step carries; a
            longer prompt is attended in chunks, each layer in turn. Every slot
            holds this many cells beyond what its layers keep.
        block_size: FlexAttention's KV block size (None: flexkv picks one for the config and device).
        device, dtype: default to the model's.

    `memory_bytes` is the memory it holds, fixed at construction;
    `memory_report()` says what each layer group keeps and holds.
    """

    def __init__(
        self,
        model,
        retention: SinkWindow,
        *,
        sliding_retention: Optional[SinkWindow] = None,
        max_streams: int = 8,
        positions: str = "stream",
        prefill_chunk: int = 64,
        block_size: Optional[int] = None,
        device=None,
        dtype: Optional[torch.dtype] = None,
    ):
        _check_retention("retention", retention)
        if sliding_retention is not None:
            _check_retention("sliding_retention", sliding_retention)
        if positions not in POSITION_MODES:
            raise ValueError(f"positions must be one of {POSITION_MODES}, got {positions!r}")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an int >= 1, got {prefill_chunk!r}")
        _check_model(model)
        dims = _model_dims(model.config)
        cfg = dims["cfg"]
        windows = _layer_windows(cfg, dims["layers"])
        groups = _layer_groups(windows, retention, sliding_retention)
        if dtype is None:
            dtype = model.dtype
        if device is None:
            device = model.device
        self.retention = retention
        self.sliding_retention = sliding_retention
        self.positions = positions
        self.model_config = cfg
        #: the model's own sliding window of each layer (None: full attention)
        self.layer_windows = tuple(windows)
        self._softcap = _softcap_of(cfg)
        self._absolute = _absolute_positions(model, cfg)
        self.manager = GroupedKVManager(
            BoundedKVConfig(
                num_layers=dims["layers"],
                num_heads=dims["kv_heads"],
                head_dim=dims["head_dim"],
                rows_per_request=1,
                max_source_len=0,
                max_sources=0,
                retention=retention,
                max_slots=max_streams,
                dtype=dtype,
                query_window=retention.window,
                max_step_tokens=prefill_chunk,
            ),
            groups,
            device=device,
            block_size=block_size,
        )
        self._rotary = _CachePositions(self.manager, model) if positions == "cache" else None
        super().__init__(layers=[_FlexKVLayer(self) for _ in range(dims["layers"])])
        self._selection: Optional[tuple] = None
        self._columns = 0
        self._pending: Optional[_Pending] = None
        # Every check passed: only now touch the model.
        enable(model)
        self._model_state = model._flexkv_state

    # ---------------------------------------------------------------- views

    @property
    def device(self) -> torch.device:
        return self.manager.device

    @property
    def dtype(self) -> torch.dtype:
        return self.manager.config.dtype

    @property
    def memory_bytes(self) -> int:
        """Bytes of device memory the cache holds (every slot of every layer, keys and values)."""
        extra = 0 if self._rotary is None else self._rotary.memory_bytes
        return self.manager.memory_bytes + extra

    @property
    def stream_bytes(self) -> int:
        """Bytes one stream's slot holds over every layer (keys, values, and un-rotated sink copies)."""
        extra = 0 if self._rotary is None else self._rotary.slot_bytes
        return self.manager.slot_bytes + extra

    def memory_report(self) -> tuple:
        """One dict per layer group: `name` (the model's layer type), `layers`, `retention` (what
        a stream keeps there), `query_window`, `slot_cells` (cells per slot and layer, including
        `prefill_chunk` cells of headroom), `slot_bytes` (one stream, over the group's layers) and
        `memory_bytes` (the group's tensors)."""
        return self.manager.memory_report()

    @property
    def streams(self) -> tuple:
        """Ids of the streams the cache holds, oldest first."""
        return self.manager.requests

    @property
    def selection(self) -> Optional[tuple]:
        """The stream id of each batch row of the next forward (None before the first one)."""
        return self._selection

    def stream_length(self, stream_id: Hashable) -> int:
        """Tokens a stream has written so far (0 for an id the cache does not hold)."""
        return self.manager.written(stream_id) if stream_id in self.manager.requests else 0

    # ------------------------------------------------------------ lifecycle

    def select(self, stream_ids: Sequence[Hashable]) -> "FlexKVCache":
        """Name the stream of each batch row for the following forwards; returns the cache.

        A new id starts an empty stream; a known one continues. Resets
        `get_seq_length()` to 0, so `generate()` takes the next input as new
        tokens only.
        """
        ids = tuple(stream_ids)
        if not ids:
            raise ValueError("select() needs at least one stream id")
        if len(set(ids)) != len(ids):
            raise ValueError(f"select(): stream ids must be distinct, got {list(ids)}")
        if any(i is None for i in ids):
            raise ValueError("select(): None is not a valid stream id")
        self._no_pending("select()")
        self._selection = ids
        self._columns = 0
        return self

    def drop(self, stream_id: Hashable) -> None:
        """Forget a stream and free its slot."""
        self._no_pending("drop()")
        self.manager.remove_request(stream_id)

    def reset(self) -> None:
        """Forget every stream and the selection (transformers' `Cache.reset`)."""
        if self._pending is not None:
            self.rollback()
        for sid in self.manager.requests:
            self.drop(sid)
        self._selection = None
        self._columns = 0

    def _no_pending(self, what: str) -> None:
        if self._pending is not None:
            raise ValueError(
                f"{what} while a planned forward is pending: call cache.commit() after a forward you planned "
                f"with cache.prepare(), or cache.rollback() if it failed"
            )

    def _unsupported(self, what: str):
        raise ValueError(
            f"FlexKVCache does not support {what}: each batch row is one stream with a fixed slot; "
            f"use greedy or sampled decoding with one sequence per stream"
        )

    # ---------------------------------------------- transformers Cache API

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Called by every attention layer before attention; the write happens in `flexkv_attention_forward`."""
        if self._pending is None:
            raise RuntimeError(
                "FlexKVCache was handed to a forward it did not plan: call the model itself (its flexkv hooks "
                "plan each forward), or pass **cache.prepare(input_ids, attention_mask) to a bare forward and "
                "call cache.commit() after it"
            )
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns fed since the last `select()` (what `generate()` slices its input by)."""
        return self._columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple:
        """The SDPA mask transformers builds inside the forward is unused: keep it `T x T`."""
        return query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """0: read inside the forward, so a changing value would recompile a compiled forward every token."""
        return 0

    def get_max_length(self, layer_idx=None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    def reorder_cache(self, beam_idx):
        self._unsupported("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int):
        self._unsupported("crop (assisted or speculative decoding)")

    def batch_repeat_interleave(self, repeats: int):
        self._unsupported("batch_repeat_interleave (num_return_sequences > 1)")

    def batch_select_indices(self, indices):
        self._unsupported("batch_select_indices")

    # ------------------------------------------------------------- planning

    def _check_layer(self, layer_idx: int, sliding_window, softcap) -> None:
        """Host check, per layer and forward: what the model asks for is what the cache serves."""
        want = self.layer_windows[layer_idx]
        if sliding_window is not None and sliding_window != want:
            raise ValueError(
                f"layer {layer_idx} passes sliding_window={sliding_window} to its attention, but the cache read the "
                f"model's config as {'full attention' if want is None else f'sliding_window={want}'} for it; "
                f"config.layer_types / sliding_window do not describe this model"
            )
        if softcap is not None and self._softcap != float(softcap):
            raise ValueError(
                f"layer {layer_idx} passes softcap={softcap}, but config.attn_logit_softcapping is {self._softcap}"
            )

    def _rows(self, batch: int) -> tuple:
        rows = self._selection if self._selection is not None else tuple(range(batch))
        if len(rows) != batch:
            raise ValueError(
                f"the forward has {batch} batch rows but the cache's selection names {len(rows)} "
                f"streams {list(rows)}; call cache.select([...]) with one stream id per row"
            )
        return rows

    def prepare(self, input_ids=None, attention_mask=None, *, inputs_embeds=None) -> dict:
        """Plan the next forward on the host; returns the keywords to pass to it.

        `input_ids [B, T]` (or `inputs_embeds [B, T, E]`) give the shape;
        `attention_mask` is the usual 2-D padding mask whose last `T` columns
        belong to this forward (zeros: padding). The returned dict holds
        `position_ids` (the stream positions) and `flexkv_step` (the plan).
        Until `commit()` (the forward returned) or `rollback()` (it failed)
        the forward is pending: the model runs flexkv attention, and the
        streams have not advanced. The model's hooks do all of this for
        you; call it yourself only for a bare `model.forward`.
        """
        self._no_pending("prepare()")
        ref = input_ids if input_ids is not None else inputs_embeds
        if not isinstance(ref, torch.Tensor) or ref.dim() < 2:
            raise ValueError(
                "prepare() needs input_ids [batch, tokens] or inputs_embeds [batch, tokens, hidden], "
                f"got {None if ref is None else tuple(ref.shape)}"
            )
        B, T = int(ref.shape[0]), int(ref.shape[1])
        if T < 1:
            raise ValueError("a forward through FlexKVCache needs at least one token per row")
        rows = self._rows(B)
        real = None
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
                raise ValueError(
                    "FlexKVCache takes a 2-D padding attention_mask [batch, columns] (ones: tokens, zeros: padding); "
                    f"got {type(attention_mask).__name__} of shape "
                    f"{tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else None}. "
                    "flexkv builds the attention pattern itself"
                )
            if attention_mask.shape[0] != B or attention_mask.shape[1] < T:
                raise ValueError(
                    f"attention_mask shape {tuple(attention_mask.shape)} does not cover the forward's "
                    f"{B} rows x {T} tokens"
                )
            # The one device read of the integration: which of this forward's columns are padding.
            flags = attention_mask[:, -T:].to("cpu").bool().tolist()
            if not all(all(r) for r in flags):
                real = [[t for t, f in enumerate(r) if f] for r in flags]
        lengths = [T] * B if real is None else [len(r) for r in real]
        written = [self.stream_length(sid) for sid in rows]
        if self._absolute is not None:
            limit, name = self._absolute
            for sid, w, L in zip(rows, written, lengths):
                if w + L > limit:
                    raise ValueError(
                        f"stream {sid!r} would reach length {w + L} (holds {w}, this forward adds {L}), but the model's "
                        f"learned absolute positions ({name}) stop at max_position_embeddings={limit}; start a new "
                        f"stream (cache.drop({sid!r}) and select it again), or use a model with rotary positions"
                    )

        C = self.manager.config.max_step_tokens
        longest = max(lengths)
        steps = []
        start = 0
        while start < longest or not steps:
            tokens = max(1, min(C, longest - start))
            if self._rotary is not None:
                tokens = self._rotary.chunk_limit(tokens, [w + min(start, L) for w, L in zip(written, lengths)])
            spans = [max(0, min(tokens, L - start)) for L in lengths]
            steps.append(
                BoundedKVStep(
                    segments=tuple(Segment(sid, s) for sid, s in zip(rows, spans)),
                    positions={sid: StreamPosition(0, w + min(start, L)) for sid, w, L in zip(rows, written, lengths)},
                    tokens=tokens,
                )
            )
            start += tokens
        if self._rotary is not None:
            for step in steps:
                self._rotary.check_step(step)

        m = self.manager
        known = set(m.requests)
        # Admits the new streams (atomically over every group); the later chunks continue the same
        # streams, planned at the positions they will have. Nothing is committed before the forward returns.
        m.admit(steps[0])
        new = [sid for sid in rows if sid not in known]
        try:
            plans = [m.plan(step) for step in steps]
            gather = scatter = None
            if real is not None:
                g, s = [], []
                for r in real:
                    g.append(r + [r[-1] if r else 0] * (longest - len(r)))
                    rank = {col: i for i, col in enumerate(r)}
                    s.append([rank.get(col, longest) for col in range(T)])
                gather = self._to_device(g)
                scatter = self._to_device(s)
            pos = []
            for b in range(B):
                w = written[b]
                if real is None:
                    pos.append(list(range(w, w + T)))
                else:
                    rank = {col: i for i, col in enumerate(real[b])}
                    pos.append([w + rank.get(col, 0) for col in range(T)])
            position_ids = self._to_device(pos)
        except BaseException:
            for sid in new:
                m.remove_request(sid)
            raise
        fwd = FlexKVForward(self, steps, plans, gather, scatter, position_ids)
        self._pending = _Pending(fwd, new, self._columns, self._selection)
        self._selection = rows
        self._columns += T
        _switch(self._model_state, on=True)
        return {"position_ids": position_ids, "flexkv_step": fwd}

    def commit(self) -> None:
        """Record the pending forward's tokens in their streams (it returned); the model's hooks call this."""
        p = self._pending
        if p is None:
            raise ValueError("commit(): no planned forward is pending (cache.prepare() plans one)")
        for step in p.forward.steps:
            self.manager.commit(step)
        self._pending = None
        _switch(self._model_state, on=False)

    def rollback(self) -> None:
        """Forget the pending forward (it failed): every stream, the selection and `get_seq_length()`
        return to where they were before `prepare()`; the model's hooks call this."""
        p = self._pending
        if p is None:
            raise ValueError("rollback(): no planned forward is pending (cache.prepare() plans one)")
        for sid in p.new_streams:
            if sid in self.manager.requests:
                self.manager.remove_request(sid)
        self._columns = p.columns
        self._selection = p.selection
        self._pending = None
        _switch(self._model_state, on=False)

    def _to_device(self, rows: List[list]) -> torch.Tensor:
        t = torch.tensor(rows, dtype=torch.long)
        if self.device.type == "cuda":
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def __repr__(self):
        c = self.manager.config
        groups = ", ".join(
            f"{r['name']} layers {list(r['layers'])}: {r['retention']}, {r['slot_cells']} cells per stream and layer"
            for r in self.memory_report()
        )
        return (
            f"FlexKVCache(positions={self.positions!r}, max_streams={c.max_slots}, layers={c.num_layers}, "
            f"kv_heads={c.num_heads}, head_dim={c.head_dim}, dtype={c.dtype}, groups=[{groups}], "
            f"stream_bytes={self.stream_bytes}, memory_bytes={self.memory_bytes})"
        )


def _layer_groups(windows, retention: SinkWindow, sliding_retention: Optional[SinkWindow]) -> tuple:
    """One `LayerGroup` for the full-attention layers, one per distinct sliding window."""
    full = [i for i, w in enumerate(windows) if w is None]
    groups = []
    if full:
        groups.append(LayerGroup(tuple(full), retention, retention.window, "full_attention"))
    sizes = sorted({w for w in windows if w is not None})
    for sw in sizes:
        layers = tuple(i for i, w in enumerate(windows) if w == sw)
        if sliding_retention is None:
            keep = SinkWindow(0, sw - 1)
        else:
            if sliding_retention.window + 1 > sw:
                raise ValueError(
                    f"sliding_retention window={sliding_retention.window} attends {sliding_retention.window + 1} "
                    f"tokens, more than the model's sliding_window={sw}; use window <= {sw - 1}"
                )
            keep = sliding_retention
        name = "sliding_attention" if len(sizes) == 1 else f"sliding_attention({sw})"
        groups.append(LayerGroup(layers, keep, keep.window, name))
    return tuple(groups)


# ---------------------------------------------------- cache positions

_LINEAR_ROPE = ("default", "linear", "llama3", "yarn")


def _layer_uses_rope(model, cfg, layer_idx: int) -> bool:
    flags = getattr(cfg, "no_rope_layers", None)  # SmolLM3: 1 = rotary, 0 = none
    if flags is not None and layer_idx < len(flags):
        return bool(flags[layer_idx])
    return True


class _CachePositions:
    """StreamingLLM's in-cache rotary positions per layer, through `flexkv.rotary.SinkRotation`.

    The model rotates `q` and `k` at the stream positions the cache gave it.
    Per chunk and layer this undoes that rotation with the layer's own angles
    (float32, as the model's rotary embedding computes them) and hands the
    raw `q`, `k` to the layer's `SinkRotation`, which rotates them back at
    stream positions (float64 angles) and rewrites the slot's sink cells
    rotated `e` positions on: O(sink) per step. Layers that use no rotary
    (SmolLM3's `no_rope_layers`) and layers whose group keeps no sinks
    (where in-cache and stream distances agree) are left untouched. A rope
    whose angles are not `position * inv_freq` with a fixed `inv_freq`
    cannot be undone this way and is refused.
    """

    def __init__(self, manager: GroupedKVManager, model):
        from ..rotary import Rotary, SinkRotation

        base = getattr(model, "base_model", model)
        cfg = _text_config(model.config)
        emb = getattr(base, "rotary_emb", None)
        types = getattr(cfg, "layer_types", None)
        c = manager.config
        self.layers: list = []
        self.inv_freq: list = []
        rotaries: dict = {}
        for i in range(c.num_layers):
            m, local = manager.layer_manager(i)
            g, _ = manager.group_of(i)
            if manager.managers[g].config.sink_capacity == 0 or not _layer_uses_rope(model, cfg, i):
                self.layers.append(None)
                self.inv_freq.append(None)
                continue
            layer_type = types[i] if types is not None and i < len(types) else None
            inv_freq = getattr(emb, "inv_freq", None)
            rope_type = getattr(emb, "rope_type", "default")
            if inv_freq is None and layer_type is not None:
                inv_freq = getattr(emb, f"{layer_type}_inv_freq", None)
            if isinstance(rope_type, dict):
                rope_type = rope_type.get(layer_type, "default")
            if not isinstance(inv_freq, torch.Tensor):
                raise ValueError(
                    f"positions='cache' needs the model's rotary embedding ({type(base).__name__}.rotary_emb.inv_freq) "
                    f"for layer {i}; {type(model).__name__} has none: use positions='stream'"
                )
            if rope_type not in _LINEAR_ROPE:
                raise ValueError(
                    f"positions='cache' needs angles position * inv_freq with a fixed inv_freq (rope types "
                    f"{_LINEAR_ROPE}); layer {i}'s rope_type is {rope_type!r}: use positions='stream'"
                )
            if inv_freq.numel() * 2 != c.head_dim:
                raise ValueError(
                    f"positions='cache' needs rotary over the whole head (2 * {inv_freq.numel()} frequencies "
                    f"!= head_dim {c.head_dim}): use positions='stream'"
                )
            key = id(inv_freq)
            if key not in rotaries:
                rotary = Rotary(c.head_dim).to(manager.device)
                with torch.no_grad():
                    rotary.inv_freq.copy_(inv_freq.to(torch.float64))
                rotaries[key] = (rotary, inv_freq.detach().to(device=manager.device, dtype=torch.float32).clone())
            rotary, inv32 = rotaries[key]
            self.layers.append(SinkRotation(m, local, rotary, "cache"))
            self.inv_freq.append(inv32)
        # The groups whose queries must share one eviction count within a step.
        self.groups = sorted({manager.group_of(i)[0] for i, r in enumerate(self.layers) if r is not None})
        self.manager = manager
        if not self.groups and not any(_layer_uses_rope(model, cfg, i) for i in range(c.num_layers)):
            raise ValueError(f"positions='cache' re-rotates rotary layers; {type(model).__name__} has none")
        if self.groups and emb is None:
            raise ValueError(
                f"positions='cache' needs the model's rotary embedding ({type(base).__name__}.rotary_emb); "
                f"{type(model).__name__} has none: use positions='stream'"
            )

    @property
    def memory_bytes(self) -> int:
        return sum(r.memory_bytes for r in self.layers if r is not None)

    @property
    def slot_bytes(self) -> int:
        """Un-rotated sink bytes one slot holds over every layer."""
        total = 0
        for r in self.layers:
            if r is not None and r.memory_bytes:
                rows = r.raw_sink.shape[0] // r._sink
                total += r.memory_bytes // rows
        return total

    def chunk_limit(self, tokens: int, lengths) -> int:
        """Shrink a chunk so every query in it shares one eviction count in each rotated group."""
        for g in self.groups:
            pol = self.manager.managers[g].config.retention_for(0)
            limit = pol.sink + pol.window + 1
            room = min(limit - n for n in lengths)
            tokens = max(1, min(tokens, room))
        return tokens

    def check_step(self, step: BoundedKVStep) -> None:
        from ..rotary import check_cache_step

        for g in self.groups:
            check_cache_step(self.manager.managers[g].config, step)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, plan: GroupedPlan):
        from ..rotary import rotate_half, stream_positions

        rot = self.layers[layer_idx]
        if rot is None:
            return q, k
        g, _ = self.manager.group_of(layer_idx)
        gplan = plan.plans[g]
        pos = stream_positions(gplan, k.shape[2])  # [N, T]: the positions the model rotated at
        freqs = pos.float().unsqueeze(-1) * self.inv_freq[layer_idx]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        q_raw = q * cos - rotate_half(q) * sin
        k_raw = k * cos - rotate_half(k) * sin
        return rot(q_raw, k_raw, gplan)


# ------------------------------------------------------------ model hooks


def _check_model(model) -> None:
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__} is an encoder-decoder model; FlexKVCache supports decoder-only LMs")
    if not getattr(type(model), "_supports_attention_backend", False):
        raise ValueError(
            f"{type(model).__name__} does not route its attention through transformers' AttentionInterface "
            f"(_supports_attention_backend is False), so flexkv cannot take it over"
        )


def _find_cache(args, kwargs):
    # transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name still works).
    cache = kwargs.get("past_key_values")
    if not isinstance(cache, FlexKVCache):
        cache = kwargs.get("cache")
    if not isinstance(cache, FlexKVCache):
        if any(isinstance(a, FlexKVCache) for a in args):
            raise ValueError("pass a FlexKVCache by keyword (past_key_values=... or cache=...), not positionally")
        return None
    return cache


def _pre_forward(module, args, kwargs):
    """Forward pre-hook: plan a forward that carries a FlexKVCache and hand the plan down as keywords."""
    cache = _find_cache(args, kwargs)
    if cache is None or kwargs.get("flexkv_step") is not None:
        return None
    input_ids = kwargs.get("input_ids")
    if input_ids is None and args:
        input_ids = args[0]
    if len(args) > 1:
        raise ValueError("with a FlexKVCache, pass the forward's inputs by keyword (input_ids=..., attention_mask=...)")
    extra = cache.prepare(input_ids, kwargs.get("attention_mask"), inputs_embeds=kwargs.get("inputs_embeds"))
    extra["flexkv_step"].owner = module
    kwargs = dict(kwargs)
    kwargs.update(extra)
    kwargs["attention_mask"] = None  # consumed: flexkv masks padding itself
    return args, kwargs


def _post_forward(module, args, kwargs, result):
    """Forward hook (run on success and on failure): commit the forward this module planned, or roll it back."""
    fwd = kwargs.get("flexkv_step") if isinstance(kwargs, dict) else None
    if not isinstance(fwd, FlexKVForward) or fwd.owner is not module:
        return None
    cache = fwd.cache
    if cache._pending is None or cache._pending.forward is not fwd:
        return None
    if result is None:
        cache.rollback()
    else:
        cache.commit()
    return None


class _ModelState:
    """What `enable` installed on a model: hooks, and the configs a planned forward switches to flexkv."""

    def __init__(self, handles, configs):
        self.handles = handles
        self.configs = configs
        self.depth = 0
        self.saved: list = []


def _attention_configs(model) -> list:
    """The config objects the model's attention layers and mask builders read `_attn_implementation` from."""
    found = {}
    for cfg in (model.config, _text_config(model.config)):
        found.setdefault(id(cfg), cfg)
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if isinstance(getattr(mod, "layer_idx", None), int) and hasattr(cfg, "_attn_implementation_internal"):
            found.setdefault(id(cfg), cfg)
    return list(found.values())


def _switch(state: _ModelState, on: bool) -> None:
    """Run the model's attention through flexkv (nesting counted), or restore what it was."""
    if on:
        if state.depth == 0:
            state.saved = [cfg._attn_implementation_internal for cfg in state.configs]
            for cfg in state.configs:
                cfg._attn_implementation_internal = ATTN_IMPLEMENTATION
        state.depth += 1
    else:
        state.depth = max(0, state.depth - 1)
        if state.depth == 0:
            for cfg, value in zip(state.configs, state.saved):
                cfg._attn_implementation_internal = value
            state.saved = []


def enable(model) -> None:
    """Install flexkv's forward hooks on `model` (idempotent).

    Registers the `"flexkv"` attention function and installs the hooks that
    plan a forward given a `FlexKVCache`, switch the model's attention to
    flexkv for that forward, and commit (or, if it raised, roll back) its
    tokens afterwards. Forwards without a `FlexKVCache` are untouched.
    """
    _check_model(model)
    _register()
    if getattr(model, "_flexkv_state", None) is None:
        handles = []
        mods = [model]
        base = getattr(model, "base_model", None)
        if isinstance(base, torch.nn.Module) and base is not model:
            mods.append(base)
        for mod in mods:
            handles.append(mod.register_forward_pre_hook(_pre_forward, with_kwargs=True))
            handles.append(mod.register_forward_hook(_post_forward, with_kwargs=True, always_call=True))
        model._flexkv_state = _ModelState(handles, _attention_configs(model))


def disable(model) -> None:
    """Undo `enable`: remove the hooks (a FlexKVCache built for the model no longer plans its forwards)."""
    state = getattr(model, "_flexkv_state", None)
    if state is None:
        return
    for h in state.handles:
        h.remove()
    if state.depth:
        state.depth = 1
        _switch(state, on=False)
    model._flexkv_state = None
