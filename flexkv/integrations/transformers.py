"""flexkv for Hugging Face transformers: a bounded sink + window cache for `generate()`.

`FlexKVCache(model, retention)` is a transformers `Cache` backed by a
`flexkv.BoundedKVManager` sized from the model's config. Building one
enables the model (`enable(model)`): its attention runs through the
`"flexkv"` function registered with transformers' `AttentionInterface`, and
two forward pre-hooks plan every forward that is given a `FlexKVCache` as
`past_key_values`. Llama, Mistral, Qwen2 and the other models that route
their attention through that interface need no code changes::

    from flexkv import SinkWindow
    from flexkv.integrations.transformers import FlexKVCache

    cache = FlexKVCache(model, SinkWindow(sink=4, window=1020), max_streams=8)
    out = model.generate(input_ids, attention_mask=mask, past_key_values=cache,
                         max_new_tokens=100_000, do_sample=False)

What a stream keeps and attends
    Every batch row is one **stream** (a flexkv request) with its own slot.
    The token at stream position `p` attends the stream positions `j <= p`
    with `j < sink` or `j >= p - window`: StreamingLLM's attention sinks plus
    a sliding window, applied causally inside a prompt too (flexkv's
    per-query window, `query_window = window`). Padding columns (zeros in
    the 2-D `attention_mask`) are neither written nor attended; their outputs
    are zeros.

Positions
    The cache sets `position_ids` itself: a stream's tokens take positions
    0, 1, 2, ... in the order it wrote them, whatever padding or call they
    came in. `positions="stream"` rotates every key at that stream position
    (the model's own rotary embedding, unchanged). `positions="cache"` gives
    StreamingLLM's in-cache positions: distances to the sink entries are
    measured as if the evicted entries were never there.

Streams across calls
    `cache.select(ids)` names the streams of the next forwards' rows; a new
    id starts an empty stream, a known id continues where it stopped. With no
    selection the first forward names its rows 0 .. batch-1.
    `get_seq_length()` counts the columns fed since the last selection, as
    `generate()` expects when it is handed back its own output.

Compiling
    Compile `model.forward` (not the module: the hooks must stay outside the
    graph): `model.forward = torch.compile(model.forward, fullgraph=True)`.
    Decoding then runs one graph for every token; the plan of each step is an
    input of that graph.

Supported transformers releases: see `SUPPORTED_TRANSFORMERS`; any other
release fails at import with one message that says what to install.
"""

from __future__ import annotations

import math
import re
from typing import Hashable, List, Optional, Sequence

import torch

from ..config import BoundedKVConfig, SinkWindow
from ..manager import BoundedKVManager
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
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
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
    tokens, already rotated). Returns `([B, T, Hq, D], None)`. A forward that
    was not planned by a `FlexKVCache` (no `flexkv_step`) runs PyTorch SDPA
    with the mask transformers built, so the model stays usable with other
    caches or none.
    """
    if flexkv_step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if module.training and dropout > 0:
        raise ValueError(
            f"flexkv attention is for inference: got dropout={dropout} in training mode; call model.eval()"
        )
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"flexkv attention does not support the {name!r} argument this model passes "
                f"({type(module).__name__}); use a model without it"
            )
    out = flexkv_step.attend(module.layer_idx, query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, flexkv_attention_forward)
    # A forward without a FlexKVCache falls back to SDPA, which needs SDPA's masks.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


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

    def __init__(self, cache: "FlexKVCache", plans, gather, scatter, position_ids):
        self.cache = cache
        self.manager = cache.manager
        self.plans = tuple(plans)
        #: `[B, T']` column of each stream token (None: every column is a token)
        self.gather = gather
        #: `[B, T]` index into the `T' + 1` outputs for each column (`T'`: zeros)
        self.scatter = scatter
        #: `[B, T]` the stream position of each column
        self.position_ids = position_ids
        #: "cache" positions: re-rotates the step's q/k and rewrites the sink cells per layer
        self.rotary = cache._rotary

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale=None) -> torch.Tensor:
        """Attend layer `layer_idx` for the whole forward: `[B, Hq, T, D]` in, `[B, Hq, T, D]` out."""
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
            outs.append(self.manager.attend(layer_idx, qc, kc, vc, plan, scale=scale))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        if self.scatter is not None:
            out = _take(torch.cat([out, out.new_zeros(out.shape[0], out.shape[1], 1, out.shape[3])], dim=2), self.scatter)
        return out


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


def _model_dims(config) -> dict:
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
    layers = getattr(cfg, "num_hidden_layers", None)
    for name, val in (("num_hidden_layers", layers), ("num_attention_heads", heads), ("head_dim", head_dim)):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"model config has no usable {name} (got {val!r}); FlexKVCache needs a decoder-only LM config")
    return dict(cfg=cfg, layers=layers, kv_heads=kv_heads, head_dim=head_dim)


class FlexKVCache(Cache):
    """A bounded sink + window KV cache for a transformers causal LM, one stream per batch row.

    Args:
        model: a `PreTrainedModel` whose attention goes through transformers'
            `AttentionInterface` (Llama, Mistral, Qwen2, ...). It is enabled
            (see `enable`); its layers, KV heads, head dim, dtype and device
            size the cache.
        retention: `SinkWindow(sink, window)`: each stream keeps its first
            `sink` and its last `window` tokens, and each token attends those
            plus itself.
        max_streams: streams the cache holds at once (slots); memory is
            allocated for all of them up front.
        positions: `"stream"` or `"cache"` (see the module docstring).
        prefill_chunk: the most tokens per row one flexkv step carries; a
            longer prompt is attended in chunks, each layer in turn. Every slot
            holds this many cells beyond `sink + window`.
        block_size: FlexAttention's KV block size.
        device, dtype: default to the model's.

    `memory_bytes` is the memory it holds, fixed at construction.
    """

    def __init__(
        self,
        model,
        retention: SinkWindow,
        *,
        max_streams: int = 8,
        positions: str = "stream",
        prefill_chunk: int = 64,
        block_size: int = 128,
        device=None,
        dtype: Optional[torch.dtype] = None,
    ):
        if not isinstance(retention, SinkWindow):
            raise ValueError(
                f"retention must be a flexkv.SinkWindow(sink, window), got {retention!r}"
            )
        if retention.window_includes_step:
            raise ValueError(
                f"retention {retention} has window_includes_step=True; a language model's tokens attend "
                f"themselves on top of the window: use SinkWindow(sink, window) (window_includes_step=False)"
            )
        if positions not in POSITION_MODES:
            raise ValueError(f"positions must be one of {POSITION_MODES}, got {positions!r}")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an int >= 1, got {prefill_chunk!r}")
        enable(model)
        dims = _model_dims(model.config)
        _check_sliding_window(dims["cfg"], retention)
        if dtype is None:
            dtype = model.dtype
        if device is None:
            device = model.device
        self.retention = retention
        self.positions = positions
        self.model_config = dims["cfg"]
        self.manager = BoundedKVManager(
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
            device=device,
            block_size=block_size,
        )
        super().__init__(layers=[_FlexKVLayer(self) for _ in range(dims["layers"])])
        self._selection: Optional[tuple] = None
        self._columns = 0
        self._planned = False  # whether any forward was planned (update() refuses unplanned ones)
        self._rotary = None
        if positions == "cache":
            self._init_cache_positions(model)

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
        self._selection = ids
        self._columns = 0
        return self

    def drop(self, stream_id: Hashable) -> None:
        """Forget a stream and free its slot."""
        self.manager.remove_request(stream_id)

    def reset(self) -> None:
        """Forget every stream and the selection (transformers' `Cache.reset`)."""
        for sid in self.manager.requests:
            self.drop(sid)
        self._selection = None
        self._columns = 0

    def _unsupported(self, what: str):
        raise ValueError(
            f"FlexKVCache does not support {what}: each batch row is one stream with a fixed slot; "
            f"use greedy or sampled decoding with one sequence per stream"
        )

    # ---------------------------------------------- transformers Cache API

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Called by every attention layer before attention; the write happens in `flexkv_attention_forward`."""
        if not self._planned:
            raise RuntimeError(
                "FlexKVCache was handed to a forward it did not plan: call the model itself (its flexkv hooks "
                "plan each forward), or pass **cache.prepare(input_ids, attention_mask) to a bare forward"
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

    def _rows(self, batch: int) -> tuple:
        if self._selection is None:
            self._selection = tuple(range(batch))
        if len(self._selection) != batch:
            raise ValueError(
                f"the forward has {batch} batch rows but the cache's selection names {len(self._selection)} "
                f"streams {list(self._selection)}; call cache.select([...]) with one stream id per row"
            )
        return self._selection

    def prepare(self, input_ids=None, attention_mask=None, *, inputs_embeds=None) -> dict:
        """Plan the next forward on the host; returns the keywords to pass to it.

        `input_ids [B, T]` (or `inputs_embeds [B, T, E]`) give the shape;
        `attention_mask` is the usual 2-D padding mask whose last `T` columns
        belong to this forward (zeros: padding). The returned dict holds
        `position_ids` (the stream positions) and `flexkv_step` (the plan).
        The streams' lengths advance now: pass the result to exactly one
        forward. The model's hooks call this for you.
        """
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

        C = self.manager.config.max_step_tokens
        longest = max(lengths)
        # In "cache" mode every query of a step must share one eviction count: once a row's
        # stream reaches sink + window, its tokens go one per step.
        limit = self.retention.sink + self.retention.window + 1
        plans = []
        m = self.manager
        start = 0
        while start < longest or not plans:
            tokens = max(1, min(C, longest - start))
            if self._rotary is not None:
                room = min(limit - (w + min(start, L)) for w, L in zip(written, lengths))
                tokens = max(1, min(tokens, room))
            spans = [max(0, min(tokens, L - start)) for L in lengths]
            step = BoundedKVStep(
                segments=tuple(Segment(sid, s) for sid, s in zip(rows, spans)),
                positions={sid: StreamPosition(0, w + min(start, L)) for sid, w, L in zip(rows, written, lengths)},
                tokens=tokens,
            )
            m.admit(step)
            if self._rotary is not None:
                self._rotary.check_step(step)
            plans.append(m.plan(step))
            m.commit(step)
            start += tokens

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
        self._columns += T
        fwd = FlexKVForward(self, plans, gather, scatter, position_ids)
        self._planned = True
        return {"position_ids": position_ids, "flexkv_step": fwd}

    def _to_device(self, rows: List[list]) -> torch.Tensor:
        t = torch.tensor(rows, dtype=torch.long)
        if self.device.type == "cuda":
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    # ---------------------------------------------------- cache positions

    def _init_cache_positions(self, model) -> None:
        self._rotary = _CachePositions(self.manager, model)

    def __repr__(self):
        c = self.manager.config
        return (
            f"FlexKVCache(retention={self.retention}, positions={self.positions!r}, max_streams={c.max_slots}, "
            f"layers={c.num_layers}, kv_heads={c.num_heads}, head_dim={c.head_dim}, dtype={c.dtype}, "
            f"memory_bytes={self.memory_bytes})"
        )


_LINEAR_ROPE = ("default", "linear", "llama3", "yarn")


class _CachePositions:
    """StreamingLLM's in-cache rotary positions for every layer, through `flexkv.rotary.SinkRotation`.

    The model rotates `q` and `k` at the stream positions the cache gave it.
    Per chunk and layer this undoes that rotation with the model's own
    angles (float32, as its rotary embedding computes them) and hands the
    raw `q`, `k` to the layer's `SinkRotation`, which rotates them back at
    stream positions (float64 angles) and rewrites the slot's sink cells
    rotated `e` positions on: O(sink) per step. A rope whose angles are not
    `position * inv_freq` with a fixed `inv_freq` cannot be undone this way.
    """

    def __init__(self, manager: BoundedKVManager, model):
        from ..rotary import Rotary, SinkRotation

        base = getattr(model, "base_model", model)
        emb = getattr(base, "rotary_emb", None)
        inv_freq = getattr(emb, "inv_freq", None)
        rope_type = getattr(emb, "rope_type", "default")
        c = manager.config
        if not isinstance(inv_freq, torch.Tensor):
            raise ValueError(
                f"positions='cache' needs the model's rotary embedding ({type(base).__name__}.rotary_emb.inv_freq); "
                f"{type(model).__name__} has none: use positions='stream'"
            )
        if rope_type not in _LINEAR_ROPE:
            raise ValueError(
                f"positions='cache' needs angles position * inv_freq with a fixed inv_freq (rope types "
                f"{_LINEAR_ROPE}); this model's rope_type is {rope_type!r}: use positions='stream'"
            )
        if inv_freq.numel() * 2 != c.head_dim:
            raise ValueError(
                f"positions='cache' needs rotary over the whole head (2 * {inv_freq.numel()} frequencies "
                f"!= head_dim {c.head_dim}): use positions='stream'"
            )
        rotary = Rotary(c.head_dim).to(manager.device)
        with torch.no_grad():
            rotary.inv_freq.copy_(inv_freq.to(torch.float64))
        self.inv_freq = inv_freq.detach().to(device=manager.device, dtype=torch.float32).clone()
        self.rotary = rotary
        self.layers = [SinkRotation(manager, i, rotary, "cache") for i in range(c.num_layers)]

    @property
    def memory_bytes(self) -> int:
        return sum(layer.memory_bytes for layer in self.layers)

    def check_step(self, step: BoundedKVStep) -> None:
        self.layers[0].check_step(step)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, plan):
        from ..rotary import rotate_half, stream_positions

        pos = stream_positions(plan, k.shape[2])  # [N, T]: the positions the model rotated at
        freqs = pos.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        q_raw = q * cos - rotate_half(q) * sin
        k_raw = k * cos - rotate_half(k) * sin
        return self.layers[layer_idx](q_raw, k_raw, plan)


def _check_sliding_window(cfg, retention: SinkWindow) -> None:
    """Refuse a window wider than the model's own sliding window (a span it never attended in training)."""
    sw = getattr(cfg, "sliding_window", None)
    if not isinstance(sw, int) or sw <= 0:
        return
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return
    if getattr(cfg, "use_sliding_window", True) is False:
        return
    if retention.window + 1 > sw:
        raise ValueError(
            f"retention window={retention.window} attends {retention.window + 1} tokens, more than the model's "
            f"sliding_window={sw}; use window <= {sw - 1}"
        )


# ------------------------------------------------------------ model hooks


def _pre_forward(module, args, kwargs):
    """Forward pre-hook: plan a forward that carries a FlexKVCache and hand the plan down as keywords."""
    # transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name still works).
    cache = kwargs.get("past_key_values")
    if not isinstance(cache, FlexKVCache):
        cache = kwargs.get("cache")
    if not isinstance(cache, FlexKVCache):
        if any(isinstance(a, FlexKVCache) for a in args):
            raise ValueError("pass a FlexKVCache by keyword (past_key_values=... or cache=...), not positionally")
        return None
    if kwargs.get("flexkv_step") is not None:
        return None
    input_ids = kwargs.get("input_ids")
    if input_ids is None and args:
        input_ids = args[0]
    if len(args) > 1:
        raise ValueError("with a FlexKVCache, pass the forward's inputs by keyword (input_ids=..., attention_mask=...)")
    extra = cache.prepare(input_ids, kwargs.get("attention_mask"), inputs_embeds=kwargs.get("inputs_embeds"))
    kwargs = dict(kwargs)
    kwargs.update(extra)
    kwargs["attention_mask"] = None  # consumed: flexkv masks padding itself
    return args, kwargs


def enable(model) -> None:
    """Route `model`'s attention through flexkv (idempotent).

    Registers the `"flexkv"` attention function, sets it as the model's
    attention implementation and installs the forward pre-hooks that plan
    forwards given a `FlexKVCache`. Forwards without one run PyTorch SDPA.
    """
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__} is an encoder-decoder model; FlexKVCache supports decoder-only LMs")
    if not getattr(type(model), "_supports_attention_backend", False):
        raise ValueError(
            f"{type(model).__name__} does not route its attention through transformers' AttentionInterface "
            f"(_supports_attention_backend is False), so flexkv cannot take it over"
        )
    _register()
    if getattr(model, "_flexkv_state", None) is None:
        handles = [model.register_forward_pre_hook(_pre_forward, with_kwargs=True)]
        base = getattr(model, "base_model", None)
        if isinstance(base, torch.nn.Module) and base is not model:
            handles.append(base.register_forward_pre_hook(_pre_forward, with_kwargs=True))
        model._flexkv_state = (handles, model.config._attn_implementation)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)


def disable(model) -> None:
    """Undo `enable`: remove the hooks and restore the previous attention implementation."""
    state = getattr(model, "_flexkv_state", None)
    if state is None:
        return
    handles, previous = state
    for h in handles:
        h.remove()
    model._flexkv_state = None
    model.set_attn_implementation(previous or "sdpa")
