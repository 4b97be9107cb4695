"""The transformers `Cache` API of a `FlexKVCache`: what the model and `generate()` call on it.

A transformers model talks to its cache through `Cache` (per layer:
`update` before attention; `get_conv_state` / `update_conv_state` /
`get_recurrent_state` / `update_recurrent_state` in recurrent layers;
`get_seq_length`, `get_mask_sizes` and friends for masks and positions) and
through per-layer `CacheLayerMixin` / `LinearAttentionCacheLayerMixin`
objects whose types say what each layer is. `CacheShim` answers all of it
for a cache whose data lives in flexkv: attention keys and values are
written by the `"flexkv"` attention function, recurrent states are read and
staged through the cache's `RecurrentStates`; the shim only routes calls.
Reordering, cropping and copying rows are the cache's own
(`flexkv.integrations.transformers.branching`); a layer asked for them alone
refuses, since a stream is one slot over every layer.
"""

from __future__ import annotations

from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin

__all__ = ["CacheShim", "AttentionLayerView", "RecurrentLayerView", "HybridLayerView"]


class _LayerView:
    """What every per-layer view shares: it belongs to a cache and holds no data of its own."""

    is_compileable = False
    is_croppable = False

    def _init_view(self, owner, layer_idx: int) -> None:
        self.owner = owner
        self.layer_idx = layer_idx
        self.is_initialized = True

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        pass

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass

    def reorder_cache(self, beam_idx) -> None:
        self.owner._unsupported("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        self.owner._unsupported("crop (assisted or speculative decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.owner._unsupported("batch_repeat_interleave (copying a stream's rows)")

    def batch_select_indices(self, indices) -> None:
        self.owner._unsupported("batch_select_indices")


class AttentionLayerView(_LayerView, CacheLayerMixin):
    """An attention layer as transformers' `Cache` bookkeeping sees it; its keys and values live in flexkv."""

    is_sliding = False

    def __init__(self, owner, layer_idx: int):
        CacheLayerMixin.__init__(self)
        self._init_view(owner, layer_idx)

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple:
        """The mask transformers builds inside the forward is unused (flexkv masks itself): keep it `T x T`."""
        return query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.selected.columns


class RecurrentLayerView(_LayerView, LinearAttentionCacheLayerMixin):
    """A recurrent layer (linear attention, Mamba, short convolution); its state lives in the cache's buffers."""

    def __init__(self, owner, layer_idx: int):
        LinearAttentionCacheLayerMixin.__init__(self)
        self._init_view(owner, layer_idx)

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0, **kwargs) -> None:
        pass

    def update_conv_state(self, conv_states, state_idx: int = 0, **kwargs):
        return self.owner.update_conv_state(conv_states, self.layer_idx, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs):
        return self.owner.update_recurrent_state(recurrent_states, self.layer_idx, state_idx, **kwargs)

    def activate_past_recording(self) -> None:
        self.owner._unsupported("recording past recurrent states (assisted or speculative decoding)")


class HybridLayerView(RecurrentLayerView, AttentionLayerView):
    """A layer that runs attention and a recurrent mixer side by side (Falcon-H1)."""

    def __init__(self, owner, layer_idx: int):
        AttentionLayerView.__init__(self, owner, layer_idx)
        RecurrentLayerView.__init__(self, owner, layer_idx)

    def lazy_initialization(self, *args, **kwargs) -> None:
        pass


class CacheShim(Cache):
    """transformers' `Cache` API over flexkv state; `FlexKVCache` supplies the state and the planning.

    Subclasses provide `selected` (`selection.Selection`), `_pending` (the planned forward in flight,
    or None), `_recurrent` (a `RecurrentStates`, or None), `_planned(what)`
    (the pending `FlexKVForward`, or an error naming `what`) and
    `_unsupported(what)` (raises).
    """

    # ------------------------------------------------------------ attention

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Called by every attention layer before attention; the write happens in `flexkv_attention_forward`."""
        self._planned("update")
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns fed since the last `select()` (what `generate()` slices its input by)."""
        return self.selected.columns

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """0: read inside the forward, so a changing value would recompile a compiled forward every token."""
        return 0

    @property
    def is_compileable(self) -> bool:
        """True: a forward's plan is an input of the graph, so a compiled decode step compiles once
        (transformers' `generate(compile_config=...)` compiles it; `enable` keeps the 2-D padding
        mask that flexkv plans from, where transformers would build 4-D masks for such a cache)."""
        return True

    @property
    def is_croppable(self) -> bool:
        return False

    # `get_mask_sizes`, `get_max_length` and what a bounded cache refuses (`reorder_cache`, `crop`,
    # `batch_repeat_interleave`, `batch_select_indices`, `activate_past_recording`) are answered
    # by the layer views: transformers' `Cache` hands each of them to its layers.

    def early_initialization(self, *args, **kwargs):
        """Nothing to do: every buffer was allocated when the cache was built."""

    # ------------------------------------------------------- recurrent layers

    def _states(self, what: str, layer_idx: int):
        fwd = self._planned(what)
        if self._recurrent is None or not self._recurrent.holds(layer_idx):
            raise ValueError(
                f"{what}: layer {layer_idx} keeps no recurrent state in this cache (its config names it an "
                f"attention layer); config.layer_types does not describe this model"
            )
        return fwd

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        """Layer `layer_idx`'s convolution state for this forward's rows (None when every row starts a stream)."""
        fwd = self._states("get_conv_state", layer_idx)
        return self._recurrent.read(fwd, layer_idx, "conv", state_idx)

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, **kwargs):
        """Stage the convolution state after this forward's columns; returns the layer's full conv input."""
        fwd = self._states("update_conv_state", layer_idx)
        return self._recurrent.write_conv(fwd, layer_idx, state_idx, conv_states)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        """Layer `layer_idx`'s recurrent state for this forward's rows (None when every row starts a stream)."""
        fwd = self._states("get_recurrent_state", layer_idx)
        return self._recurrent.read(fwd, layer_idx, "recurrent", state_idx)

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        """Stage the recurrent state after this forward's columns (written to the slots on commit)."""
        fwd = self._states("update_recurrent_state", layer_idx)
        return self._recurrent.write(fwd, layer_idx, "recurrent", state_idx, recurrent_states)

    def has_previous_state(self, layer_idx=None, state_idx=None) -> bool:
        """Whether the planned forward continues a stream (then every row's state is read, zeros for new rows)."""
        pending = self._pending
        return pending is not None and self._recurrent is not None and pending.forward.continues

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    # MiniMax's lightning attention keeps one state per layer under its own names.
    def get_linear_cache(self, layer_idx: int):
        fwd = self._states("get_linear_cache", layer_idx)
        return self._recurrent.read(fwd, layer_idx, "recurrent", 0)

    def set_linear_cache(self, layer_idx: int, linear_cache):
        fwd = self._states("set_linear_cache", layer_idx)
        self._recurrent.write(fwd, layer_idx, "recurrent", 0, linear_cache)

    def __len__(self):
        return len(self.layers)

    def __iter__(self):
        raise TypeError("a FlexKVCache holds no per-layer key and value tensors to iterate over")
