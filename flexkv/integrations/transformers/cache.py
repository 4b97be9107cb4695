"""`FlexKVCache`: a bounded cache for a transformers causal LM, one stream per batch row."""

from __future__ import annotations

import weakref
from typing import Hashable, List, Optional, Sequence

import torch
from transformers.cache_utils import Cache
from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING

from ...cache.host.slots import SlotsExhausted
from ...cache.manager import BoundedKVManager
from ...cache.positions.rotary import ROPE_POSITIONS
from ...config import BoundedKVConfig, SinkWindow
from ...model.step_context import StepContext
from .branching import BranchingCache
from .cache_positions import CachePositions, warn_past_trained_context
from .hooks import enable, switch
from .model_config import RECURRENT_TYPES
from .model_survey import check_retention, own_cache_class, survey
from .plan import FlexKVForward, Pending, chunk_steps, compiled_forward, forward_columns, real_columns
from .recurrent import check_recurrent_forward
from .registration import release_compile_globals
from .selection import Selection
from .shim import AttentionLayerView, CacheShim, HybridLayerView, RecurrentLayerView

__all__ = ["FlexKVCache"]

#: (cache class, the model's own cache class) -> a subclass of both (`FlexKVCache.__new__`)
_WITH_OWN_CLASS: dict = {}


class FlexKVCache(BranchingCache, CacheShim):
    """A bounded cache for a transformers causal LM, one stream per batch row.

    Args:
        model: a `PreTrainedModel` whose attention layers go through
            transformers' attention interface. Its layers, layer types,
            sliding window, KV heads, head sizes, recurrent states, dtype and
            device size the cache; hooks are installed on it (see `enable`).
        retention: `SinkWindow(sink, window)` for the model's full-attention
            layers: each stream keeps its first `sink` and its last `window`
            tokens there, and each token attends those plus itself. None for
            a model without full-attention layers (every layer slides, as in
            Mistral), and only there: a retention that no layer would use is
            refused, as is None where full-attention layers need one.
        sliding_retention: what the model's sliding-window layers keep.
            None (default): exactly the model's window (`SinkWindow(0,
            sliding_window - 1)`). A `SinkWindow` replaces it (e.g. to add
            sinks); its window is at most `sliding_window - 1` (what the model's
            own layer reads before the query). Refused for a model without
            sliding-window layers (it would be used nowhere).
        max_streams: streams the cache holds at once (slots); memory is
            allocated for all of them up front.
        rope_positions: `"cache"` (StreamingLLM's in-cache positions, which
            keep a model's quality past its trained context) or `"stream"`
            (the stream index, what the model sees without a cache). None
            (default): `"cache"` wherever flexkv serves it (rotary layers whose
            angles are `position * inv_freq`, over the whole head; quantized
            slots too), else `"stream"`, and a stream that then
            runs past the model's trained context (`max_position_embeddings`)
            is warned about once, with the fix (docs/transformers.md,
            "Positions").
        prefill_chunk: the most tokens per row one flexkv step carries; a
            longer prompt is attended in chunks, each layer in turn. Every slot
            holds this many cells beyond what its layers keep.
        block_size: FlexAttention's KV block size (None: flexkv picks one for the config and device).
        device, dtype: default to the model's.
        slot_dtype: how the cache stores keys and values: None (in `dtype`), or `torch.int8` /
            `torch.float8_e4m3fn` for quantized slots (`flexkv.cache.storage.quantized`).
        max_rollback: the most tokens a stream may take back at once beyond
            `prefill_chunk` (assisted decoding's rejected draft tokens,
            `crop`): every slot holds `max(prefill_chunk, max_rollback)`
            cells beyond what its layers keep. 0 (default): `prefill_chunk`.

    Building the cache for a model with recurrent layers runs the model once
    on one token to read their states' shapes. `memory_bytes` is what the
    cache holds, fixed at construction; `memory_report()` says it per group
    of layers. docs/transformers.md is the full description.
    """

    def __new__(cls, model=None, *args, **kwargs):
        own = own_cache_class(model) if model is not None else None
        if own is not None and not issubclass(cls, own):
            sub = _WITH_OWN_CLASS.get((cls, own))
            if sub is None:
                sub = type(f"{cls.__name__}For{own.__name__}", (cls, own), {"__module__": cls.__module__})
                _WITH_OWN_CLASS[(cls, own)] = sub
            cls = sub
        return object.__new__(cls)

    def __init__(
        self,
        model,
        retention: Optional[SinkWindow],
        *,
        sliding_retention: Optional[SinkWindow] = None,
        max_streams: int = 8,
        rope_positions: Optional[str] = None,
        prefill_chunk: int = 64,
        block_size: Optional[int] = None,
        device=None,
        dtype: Optional[torch.dtype] = None,
        slot_dtype: Optional[torch.dtype] = None,
        max_rollback: int = 0,
    ):
        positions = "cache" if rope_positions is None else rope_positions
        if retention is not None:
            check_retention("retention", retention)
        if sliding_retention is not None:
            check_retention("sliding_retention", sliding_retention)
        if positions not in ROPE_POSITIONS:
            raise ValueError(f"rope_positions must be one of {ROPE_POSITIONS}, got {positions!r}")
        m = survey(model, retention, sliding_retention, max_streams, prefill_chunk, device)
        specs, groups, dtype = m.specs, m.groups, model.dtype if dtype is None else dtype
        device = m.device
        self.retention = retention
        self.sliding_retention = sliding_retention
        #: the rotary position mode, `"stream"` or `"cache"`
        self.rope_positions = positions
        self.model_config = m.config
        #: one `LayerSpec` per model layer (what it attends, what state it keeps)
        self.layer_specs = tuple(specs)
        #: the model's own sliding window of each layer (None: full attention, or no attention)
        self.layer_windows = tuple(s.window for s in specs)
        #: model layer -> the KV layer it attends (None: a recurrent-only layer)
        self.kv_layer = tuple(m.kv_layer)
        self._kv_owner = tuple(s.index for s in specs if s.attends and s.kv_source == s.index)
        self._softcap = m.softcap
        self._absolute = m.absolute
        self._restarts = m.restarts
        self.manager = self._build_manager(groups, len(self._kv_owner), max_streams, dtype, prefill_chunk,
                                           slot_dtype, max_rollback, device, block_size)
        #: The forward's step: one `flexkv.model.step_context.StepContext` over the cache, whose model layers attend their
        #: KV layers (None: recurrent only); its transaction and attendance check are every forward's.
        self.context = StepContext(self.manager, layers=tuple(kv if s.attends else None
                                                              for s, kv in zip(specs, self.kv_layer)))
        self._recurrent = m.states
        self._rotary = None
        #: why the default positions are "stream" for this model (None: they are not, or were asked for)
        self.stream_positions_reason: Optional[str] = None
        self._choose_positions(model, positions, rope_positions, m)
        Cache.__init__(self, layers=[self._layer_view(s) for s in specs])
        #: the stream of each batch row, the columns they took in, the tokens they are owed (one owner)
        self.selected = Selection()
        self._pending: Optional[Pending] = None
        # Whether the last forward's attention ran eagerly (`FlexKVForward.attend`): the next one's
        # plans are then made for eager calls only (`eager_forward`).
        self._ran_eagerly = False
        # Every check passed: only now touch the model.
        enable(model)
        # The model's hook state is read when needed, not kept: disable(model) and enable(model)
        # replace it, and this cache must recover and switch through the one installed now.
        self._model = weakref.ref(model)

    def _build_manager(self, groups, num_layers: int, max_streams: int, dtype, prefill_chunk: int, slot_dtype,
                       max_rollback: int, device, block_size) -> BoundedKVManager:
        """The one bounded cache under the model's KV layers, grouped by `groups` (`survey`)."""
        first = groups[0]
        return BoundedKVManager(
            BoundedKVConfig(
                num_layers=num_layers,
                num_heads=first.num_heads,
                head_dim=first.head_dim,
                value_head_dim=first.value_head_dim,
                rows_per_request=1,
                max_source_len=0,
                max_sources=0,
                retention=first.retention,
                max_slots=max_streams,
                dtype=dtype,
                query_window=first.retention.window,
                max_step_tokens=prefill_chunk,
                slot_dtype=slot_dtype,  # quantized slots (flexkv.cache.storage.quantized); None: the model's dtype
                max_rollback=max_rollback,
                padding_segments=False,  # every row of a batch is a stream: no scratch cells for padding rows
            ),
            device,
            groups=groups,
            block_size=block_size,
        )

    def _choose_positions(self, model, positions: str, asked: Optional[str], survey_result) -> None:
        """In-cache positions where they can be served (else, unless `asked`, stream positions, saying why),
        and the trained context a stream-positioned stream is warned past."""
        if positions == "cache":
            try:
                self._rotary = CachePositions(self.manager, model, self._kv_owner)
            except ValueError as exc:
                if asked is not None:
                    raise
                # The default where in-cache positions cannot be served: stream positions, said once a stream
                # would run past what the model was trained on (`warn_past_trained_context`).
                self.rope_positions = "stream"
                self.stream_positions_reason = str(exc)
        trained = getattr(survey_result.config, "max_position_embeddings", None)
        self._trained_context = trained if self.rope_positions == "stream" and survey_result.absolute is None \
            and isinstance(trained, int) else None

    def _layer_view(self, spec):
        """The model layer's view of the cache, by what the layer keeps."""
        if spec.attends and spec.recurrent:
            return HybridLayerView(self, spec.index)
        if spec.recurrent:
            return RecurrentLayerView(self, spec.index)
        return AttentionLayerView(self, spec.index)

    # ---------------------------------------------------------------- views

    @property
    def device(self) -> torch.device:
        return self.manager.device

    @property
    def dtype(self) -> torch.dtype:
        return self.manager.config.dtype

    @property
    def memory_bytes(self) -> int:
        """Bytes of device memory the cache holds: every slot's keys and values in every attention
        layer, every slot's recurrent states, and un-rotated sink copies (`rope_positions="cache"`)."""
        extra = 0 if self._rotary is None else self._rotary.memory_bytes
        states = 0 if self._recurrent is None else self._recurrent.memory_bytes
        return self.manager.memory_bytes + extra + states

    @property
    def stream_bytes(self) -> int:
        """Bytes one stream's slot holds over every layer (keys, values, recurrent states, un-rotated sinks)."""
        extra = 0 if self._rotary is None else self._rotary.slot_bytes
        states = 0 if self._recurrent is None else self._recurrent.slot_bytes
        return self.manager.slot_bytes + extra + states

    def memory_report(self) -> tuple:
        """One dict per group of layers, attention groups first.

        Attention groups: `kind="attention"`, `name` (the model's layer type),
        `layers` (the model layers whose keys and values the group holds),
        `shared_by` (layers that attend those keys and values without holding
        their own), `retention` (what a stream keeps there), `query_window`,
        `num_heads`, `head_dim`, `value_head_dim`, `slot_cells` (cells per slot
        and layer, including `prefill_chunk` cells of headroom), `slot_bytes`
        (one stream, over the group's layers) and `memory_bytes` (the
        group's tensors). Recurrent groups: `kind="recurrent"`, `name`,
        `layers`, `states` (`(kind, index, shape, dtype)` one stream keeps
        per layer), `slot_bytes`, `memory_bytes`.
        """
        out = []
        owners = self._kv_owner
        for row in self.manager.memory_report():
            kv = set(row["layers"])
            row = dict(row, kind="attention", layers=tuple(owners[k] for k in row["layers"]))
            row["shared_by"] = tuple(
                s.index for s in self.layer_specs
                if s.attends and s.kv_source != s.index and self.kv_layer[s.index] in kv
            )
            out.append(row)
        if self._recurrent is not None:
            types = [s.layer_type for s in self.layer_specs]
            out.extend(dict(row, kind="recurrent") for row in self._recurrent.report(types))
        return tuple(out)

    @property
    def streams(self) -> tuple:
        """Ids of the streams the cache holds, oldest first."""
        return self.manager.requests

    @property
    def selection(self) -> Optional[tuple]:
        """The stream id of each batch row of the next forward (None before the first one)."""
        return self.selected.streams

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
        for i in ids:
            try:
                hash(i)
            except TypeError:
                raise ValueError(f"select(): stream ids must be hashable (a str, an int, a tuple), got {i!r}") from None
        if len(set(ids)) != len(ids):
            raise ValueError(f"select(): stream ids must be distinct, got {list(ids)}")
        if any(i is None for i in ids):
            raise ValueError("select(): None is not a valid stream id")
        self.recover_forward()
        self._no_pending("select()")
        self.selected.select(ids)
        return self

    def finish(self, stream_id: Hashable) -> None:
        """End a stream: forget it and free its slot (`StreamSession.finish` for one batch row)."""
        self.recover_forward()
        self._no_pending("finish()")
        if stream_id not in self.manager.requests:
            raise ValueError(f"finish(): no stream {stream_id!r}; the cache holds {list(self.manager.requests)}")
        self.manager.remove_request(stream_id)
        self.selected.forget(stream_id)

    def reset(self) -> None:
        """Forget every stream and the selection (transformers' `Cache.reset`)."""
        if self._pending is not None:
            self.rollback()
        for sid in self.manager.requests:
            self.finish(sid)
        self.selected.clear()

    @property
    def _model_state(self):
        """The model's hook state (`hooks.ModelState`) as installed now; None after `disable(model)`."""
        model = self._model()
        return None if model is None else getattr(model, "_flexkv_state", None)

    # ------------------------------------------- what the door's hooks and steps read of the cache

    @property
    def pending_forward(self) -> Optional[Pending]:
        """The forward `prepare` planned and no `commit` or `rollback` has ended yet (None between forwards)."""
        return self._pending

    @property
    def cache_positions(self):
        """The in-cache rotary positions the cache serves (`cache_positions.CachePositions`), or None (stream
        positions)."""
        return self._rotary

    @property
    def bound_model(self):
        """The model the cache was built for, or None once it is gone (the cache holds it weakly)."""
        return self._model()

    @property
    def recurrent_states(self):
        """The recurrent layers' states (`recurrent.RecurrentStates`), or None for a model without any."""
        return self._recurrent

    def note_eager_attention(self) -> None:
        """A layer of the forward ran eagerly: the next forward's plans may be made for eager calls only."""
        self._ran_eagerly = True

    def recover_forward(self) -> None:
        """Roll back a forward the model's hooks planned and never ended (interrupted)."""
        state = self._model_state
        if state is not None and state.running is not None and state.running.cache is self:
            state.recover()

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

    def _planned(self, what: str) -> FlexKVForward:
        if self._pending is None:
            raise RuntimeError(
                f"FlexKVCache was handed to a forward it did not plan ({what}): call the model itself (its flexkv "
                f"hooks plan each forward), or pass **cache.prepare(input_ids, attention_mask) to a bare forward "
                f"and call cache.commit() after it"
            )
        return self._pending.forward

    # ------------------------------------------------------------- planning

    def check_layer(self, layer_idx: int, sliding_window, softcap) -> None:
        """Host check, per layer and forward: what the model asks for is what the cache serves."""
        if not self.layer_specs[layer_idx].attends:
            raise ValueError(
                f"layer {layer_idx} runs attention, but the cache read the model's config as "
                f"{self.layer_specs[layer_idx].layer_type!r} (no attention) for it; config.layer_types does "
                f"not describe this model"
            )
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
        rows = self.selected.rows(batch)
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
        self.recover_forward()
        self._no_pending("prepare()")
        state = self._model_state
        if state is None:
            raise ValueError(
                "prepare(): the model's flexkv hooks were removed (disable(model)); call "
                "flexkv.integrations.transformers.enable(model) before planning a forward with this cache"
            )
        B, T = self._forward_shape(input_ids if input_ids is not None else inputs_embeds)
        rows = self._rows(B)
        real = real_columns(attention_mask, B, T)
        lengths = [T] * B if real is None else [len(r) for r in real]
        written = [self.stream_length(sid) for sid in rows]
        self._check_forward_reach(rows, written, lengths, real, T)
        steps = chunk_steps(rows, written, lengths, self.manager.config.max_step_tokens)
        m = self.manager
        known = set(m.requests)
        # The last forward ran eagerly and nothing says this one is compiled: plans for eager calls only.
        eager = self._ran_eagerly and not compiled_forward(self._model())
        # The whole forward is one step of the context, in chunks: the first admits the new streams, the later
        # ones continue the same streams, planned at the positions they will have. Nothing is committed
        # before the forward returns, and a forward that fails is taken back whole (`rollback`).
        ctx = self.context
        try:
            plans = ctx.begin(steps, eager_only=eager)
        except SlotsExhausted as exc:
            fresh = [sid for sid in rows if sid not in known]
            raise SlotsExhausted(
                f"this forward starts {len(fresh)} new stream(s) but the cache holds max_streams="
                f"{m.config.max_slots} and {len(known)} are taken; cache.finish() streams that ended, or build "
                f"the cache with a larger max_streams"
            ) from exc
        self._ran_eagerly = False
        new = [sid for sid in rows if sid not in known]
        try:
            gather, scatter, position_ids = (None if x is None else self._to_device(x)
                                             for x in forward_columns(real, written, T))
            state_slots = None
            if self._recurrent is not None:
                slot_of = m.slot_of
                state_slots = self._to_device([slot_of(sid) for sid in rows])
                if new:
                    self._recurrent.clear(self._to_device([slot_of(sid) for sid in new]))
            fwd = FlexKVForward(self, steps, plans, gather, scatter, position_ids, state_slots,
                                continues=any(written))
            saved = self.selected.save()
            ctx.transaction.add_undo(lambda: self._restore(fwd, saved))
        except BaseException:
            ctx.abort()
            raise
        self._pending = Pending(fwd, state)
        self.selected.advance(rows, T)
        switch(state, on=True)
        return {"position_ids": position_ids, "flexkv_step": fwd}

    def _forward_shape(self, ref) -> tuple:
        """`(B, T)` of a forward's `input_ids` or `inputs_embeds`, checked."""
        if not isinstance(ref, torch.Tensor) or ref.dim() < 2:
            raise ValueError(
                "prepare() needs input_ids [batch, tokens] or inputs_embeds [batch, tokens, hidden], "
                f"got {None if ref is None else tuple(ref.shape)}"
            )
        B, T = int(ref.shape[0]), int(ref.shape[1])
        if T < 1:
            raise ValueError(
                f"a forward through FlexKVCache needs at least one token per row, got input of shape "
                f"{tuple(ref.shape)}" + (
                    f"; the selected streams were fed {self.selected.columns} columns since select() (get_seq_length()), "
                    f"which generate() slices off the front of input_ids: to continue with only new ids, call "
                    f"cache.select(stream_ids) before generate()" if self.selected.columns else ""))
        return B, T

    def _check_forward_reach(self, rows, written, lengths, real, T: int) -> None:
        """Refuse a forward past the model's learned absolute positions or a recurrent layer's rules; warn
        (once per cache) past its trained context."""
        if self._absolute is not None:
            limit, name = self._absolute
            for sid, w, L in zip(rows, written, lengths):
                if w + L > limit:
                    raise ValueError(
                        f"stream {sid!r} would reach length {w + L} (holds {w}, this forward adds {L}), but the model's "
                        f"learned absolute positions ({name}) stop at max_position_embeddings={limit}; start a new "
                        f"stream (cache.finish({sid!r}) and select it again), or use a model with rotary positions"
                    )
        if self._trained_context is not None and warn_past_trained_context(
                rows, written, lengths, self._trained_context, self.stream_positions_reason):
            self._trained_context = None  # once per cache
        if self._recurrent is not None:
            check_recurrent_forward([s.index for s in self.layer_specs if s.recurrent], self._restarts, rows, written,
                                    real, T)

    def model_masks(self, attention_mask, forward: FlexKVForward):
        """The `attention_mask` a planned forward passes to the model.

        None for a model without recurrent layers (flexkv masks attention
        itself). A model with recurrent layers gets a dict by layer type, as
        its own forward builds one: None for attention layers, and for
        recurrent layers the forward's 2-D padding columns (None without
        padding), which their mixers zero before they update their state.
        """
        if self._recurrent is None:
            return None
        pad = None
        if forward.gather is not None and attention_mask is not None:
            pad = attention_mask[:, -forward.position_ids.shape[1]:].contiguous()
        masks = {name: None for name in LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING}
        masks.update({s.layer_type: None for s in self.layer_specs})
        masks.update({name: pad for name in RECURRENT_TYPES})
        return masks

    def commit(self) -> None:
        """Record the pending forward's tokens (and recurrent states) in their streams (it returned);
        the model's hooks call this."""
        p = self._pending
        if p is None:
            raise ValueError("commit(): no planned forward is pending (cache.prepare() plans one)")
        try:  # the commit checks (every attention layer attended once per chunk) abort it when they fail
            self.context.commit("FlexKVCache.commit")
        except BaseException:
            self.rollback()
            raise
        for step in p.forward.steps:
            for seg in step.segments:
                if seg.span:  # fed: a token generate() returned before is in the stream now, or never will be
                    self.selected.fed(seg.request_id)
        if self._recurrent is not None:
            self._recurrent.commit(p.forward)
        self._pending = None
        switch(p.state, on=False)
        release_compile_globals()

    def rollback(self) -> None:
        """Forget the pending forward (it failed): every stream, its recurrent state, the selection and
        `get_seq_length()` return to where they were before `prepare()`; the model's hooks call this."""
        p = self._pending
        if p is None:
            raise ValueError("rollback(): no planned forward is pending (cache.prepare() plans one)")
        self.context.abort()
        self._pending = None
        switch(p.state, on=False)
        release_compile_globals()

    def _restore(self, forward: FlexKVForward, saved: tuple) -> None:
        """The integration's share of a failed forward's undo: its staged recurrent states, the
        columns `get_seq_length()` counts and the selection return to where they were."""
        forward.staged = {}
        self.selected.restore(saved)

    def _to_device(self, rows: List[list]) -> torch.Tensor:
        t = torch.tensor(rows, dtype=torch.long)
        if self.device.type == "cpu":
            return t
        if self.device.type == "cuda":
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def __repr__(self):
        c = self.manager.config
        parts = []
        for r in self.memory_report():
            if r["kind"] == "attention":
                parts.append(
                    f"{r['name']} layers {list(r['layers'])}: {r['retention']}, {r['num_heads']} KV heads of "
                    f"{r['head_dim']}/{r['value_head_dim']}, {r['slot_cells']} cells per stream and layer"
                )
            else:
                states = ", ".join(f"{k} {list(shape)}" for k, _, shape, _ in r["states"])
                parts.append(f"{r['name']} layers {list(r['layers'])}: {states} per stream and layer")
        return (
            f"FlexKVCache(rope_positions={self.rope_positions!r}, max_streams={c.max_slots}, layers={len(self.layer_specs)}, "
            f"dtype={c.dtype}, groups=[{'; '.join(parts)}], stream_bytes={self.stream_bytes}, "
            f"memory_bytes={self.memory_bytes})"
        )
