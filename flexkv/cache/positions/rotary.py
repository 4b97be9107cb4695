"""Rotary position embeddings (RoPE) for streams held in a bounded cache.

A rotary model rotates each query and key by an angle proportional to its
position; the score of a query at position `p` and a key at position `j`
then depends on `j - p` only. With a bounded cache there are two choices of
position (docs/contract.md section 6):

``"stream"``
    the entry's stream index. A key is rotated once, when it is written, and
    never touched again. These are the positions the model would see running
    over the whole stream without a cache.

``"cache"``
    StreamingLLM's in-cache positions: the sink entries keep theirs and
    everything after them moves down by the number of entries evicted so
    far (`evicted = lo - sink`, contract section 6), so positions never grow past
    the cache's size. StreamingLLM's reference code, and the old transformers
    `SinkCache`, keep un-rotated keys and re-rotate every cached key at every
    step: O(window) work per layer per step.

flexkv serves ``"cache"`` in O(sink) per step. Keys are stored rotated at
their stream index, as in ``"stream"``, and queries are rotated at their
stream index too. A window key `j` and a query `p` are then at distance
`j - p`, which is exactly their in-cache distance `(j - e) - (p - e)`. Only
the sink keys are off: in-cache they sit `e` positions closer to the query
than their stream index says. So `SinkRotation` keeps each request's sink
keys un-rotated (O(sink) memory per request and layer) and, every step,
rewrites the slot's sink cells rotated at `stream index + e`. Nothing else
in the cache changes.

This needs every query of a step to share one eviction count `e`: true for
the per-step window, and for a per-query window (`query_window`) when a step
has one query or the stream has not started evicting by the step's last
query. `SinkRotation.check_step` says so on the host; a step whose queries
evicted different counts is not served by the sink cells alone (the
transformers door serves such chunks with a per-query sink part merged by
log-sum-exp, `CachePositions.attend_per_query`). It also needs the sink entries
to be written by the request (in its slot): a source's cells are shared by
every request that reads it and cannot carry a per-request rotation.

Two pair layouts (`Rotary(..., layout=...)`): ``"half"`` rotates dimension
`i` with `i + head_dim / 2` (Llama, the transformers library); ``"interleaved"``
rotates dimensions `2i` and `2i + 1` (GPT-J, GPT-NeoX's rotary on
interleaved pairs, many speech models). Both serve both position modes.

Shapes: `x` is `[N, heads, T, head_dim]` (the attention layout);
positions are `[N, T]` integer stream indices (or anything that broadcasts
to it).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from ...config import BoundedKVConfig, check_layer_index, is_int
from ...step import BoundedKVStep
from ..storage.quantized import dequantize
from ..storage.slot_copy import SlotBuffer, plan_slot_rows

__all__ = [
    "ROPE_POSITIONS",
    "Rotary",
    "ROPE_LAYOUTS",
    "rotate_half",
    "rotate_pairs",
    "apply_rotary",
    "stream_positions",
    "SinkRotation",
    "check_cache_config",
    "check_cache_step",
    "eviction_shared",
]

ROPE_POSITIONS = ("stream", "cache")
#: Which dimensions a rotation pairs: `i` with `i + D/2` ("half"), or `2i` with `2i + 1` ("interleaved").
ROPE_LAYOUTS = ("half", "interleaved")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """`[x1, x2] -> [-x2, x1]` over the last dimension (the half-split RoPE layout)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """`(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)` over the last dimension (the interleaved layout)."""
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """Rotate `x` (`[..., D]`) by angles whose cosines and sines are `cos`, `sin` (broadcast to `x`,
    laid out as `Rotary.cos_sin` gives them for `layout`)."""
    return x * cos + (rotate_pairs(x) if layout == "interleaved" else rotate_half(x)) * sin


class Rotary(nn.Module):
    """Rotary embedding of a head dimension `head_dim` with frequency base `base`.

    `layout="half"` (default) pairs dimensions `(i, i + D/2)`, as Llama and
    the transformers library do; `layout="interleaved"` pairs `(2i, 2i + 1)`,
    as GPT-J does: the same frequencies `base ** (-2i / D)` either way, only
    which dimensions turn together differs. Angles are computed in `angle_dtype` (float64
    by default) from integer positions and only then rounded to the input's
    dtype: stream indices grow without bound, and a float32 angle `p * f`
    loses about `p * 6e-8` radians, which at long streams is larger than the
    differences the position modes are tested to. Pass
    `angle_dtype=torch.float32` to reproduce a float32 implementation's
    rounding, or on a device without float64: the frequencies are then
    `1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))` and
    the angles `positions * inv_freq` in float32, bit for bit what the usual
    float32 RoPE code computes. A model that computes its frequencies another
    way (`exp(-arange * 2 log(base) / D)`, a scaled RoPE) passes its own:
    `inv_freq=` a `[head_dim / 2]` tensor, used as given in `angle_dtype`.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, *, angle_dtype: torch.dtype = torch.float64,
                 layout: str = "half", inv_freq: Optional[torch.Tensor] = None):
        super().__init__()
        if not is_int(head_dim) or head_dim < 2 or head_dim % 2:
            raise ValueError(f"Rotary: head_dim must be an even int >= 2, got {head_dim!r}")
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1:
            raise ValueError(f"Rotary: base must be a number > 1, got {base!r}")
        if angle_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"Rotary: angle_dtype must be torch.float32 or torch.float64, got {angle_dtype!r}")
        if layout not in ROPE_LAYOUTS:
            raise ValueError(
                f"Rotary: layout must be one of {ROPE_LAYOUTS} (dimension i with i + head_dim/2, or 2i with 2i + 1), "
                f"got {layout!r}"
            )
        self.head_dim = head_dim
        self.layout = layout
        self.base = float(base)
        self.angle_dtype = angle_dtype
        if inv_freq is None:
            inv_freq = 1.0 / (self.base ** (torch.arange(0, head_dim, 2, dtype=angle_dtype) / head_dim))
        elif not isinstance(inv_freq, torch.Tensor) or tuple(inv_freq.shape) != (head_dim // 2,) \
                or not inv_freq.is_floating_point():
            raise ValueError(
                f"Rotary: inv_freq must be a float tensor of shape [head_dim / 2] = [{head_dim // 2}] (one frequency "
                f"per rotated pair), got {inv_freq.shape if isinstance(inv_freq, torch.Tensor) else inv_freq!r}"
            )
        else:
            inv_freq = inv_freq.detach().to(angle_dtype).clone()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
        """Cosines and sines for integer `positions` (any shape `P`): two `[*P, head_dim]` tensors in `dtype`
        (each frequency twice: repeated for ``"half"``, side by side for ``"interleaved"``)."""
        freqs = positions.to(self.angle_dtype).unsqueeze(-1) * self.inv_freq.to(positions.device)
        if self.layout == "interleaved":
            emb = torch.repeat_interleave(freqs, 2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate `x` `[N, H, T, D]` at `positions` `[N, T]` (or `[T]`), the same position for every head."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"Rotary.rotate: x has head_dim {x.shape[-1]}, this Rotary was built for {self.head_dim}")
        cos, sin = self.cos_sin(positions, x.dtype)
        return apply_rotary(x, cos.unsqueeze(-3), sin.unsqueeze(-3), self.layout)

    forward = rotate

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}, angle_dtype={self.angle_dtype}, layout={self.layout!r}"


def stream_positions(plan, tokens: int, reverse: bool = False) -> torch.Tensor:
    """Stream index of each of a step's own tokens, `[N, T]` int64, from the plan's tensors (contract section 2).

    Token `t` of flat row `b` sits at `n[b] + t`; with `reverse` a written
    token (`t < span[b]`) sits at `n[b] + span[b] - 1 - t`. Padding rows get
    `0 + t`. Runs on the device inside a compiled step: no host sync.
    """
    t = torch.arange(tokens, device=plan.n.device).view(1, -1)
    n = plan.n.view(-1, 1).long()
    if not reverse:
        return n + t
    span = plan.span.view(-1, 1).long()
    return torch.where(t < span, n + span - 1 - t, n + t)


class SinkRotation(nn.Module):
    """Rotary positions for one layer of a `BoundedKVManager`, in ``"stream"`` or ``"cache"`` mode.

    `forward(q, k, plan)` returns `q` and `k` rotated at the step's stream
    positions, ready for `manager.attend(layer_idx, q, k, v, plan)`. In
    ``"cache"`` mode it also stores the un-rotated keys of sink entries the
    step writes and rewrites every row's sink cells in the layer's key
    tensor, rotated `e` positions further on (`e` = entries evicted so far),
    which makes the attention exactly StreamingLLM's in-cache rotary
    attention (see the module docstring). Cost per step: `sink` cells per
    row, never the window.

    Args:
        manager: the cache whose layer `layer_idx` this serves.
        layer_idx: which layer.
        rotary: the model's `Rotary` (its `head_dim` must be the cache's).
        mode: ``"stream"`` or ``"cache"``.

        rotated_inputs: `q` and `k` come already rotated at their stream
            positions (a model that applies its own rotary embedding, as
            transformers models do). `forward` then leaves both as they are
            and keeps the sink keys as written; the sink cells are rewritten
            rotated by `e` alone, which is the same rotation (rotations add).
            Nothing is un-rotated: a step costs the `sink` cells only.

    Host side, call `check_step(step)` before planning a step in ``"cache"``
    mode (`flexkv.model.step_context.StepContext` does it); it raises `ValueError` for a
    step whose queries do not share one eviction count.
    """

    def __init__(self, manager, layer_idx: int, rotary: Rotary, mode: str = "stream", *, rotated_inputs: bool = False):
        super().__init__()
        # A BoundedKVManager (not imported here: the manager builds these, see its `rotation`), whose
        # `store` (`flexkv.cache.storage.store.LayerStore`) holds the layer's keys; or that store itself.
        store = getattr(manager, "store", manager)
        if not all(hasattr(store, a) for a in ("layout", "config", "write_keys", "keep_slot_state")):
            raise ValueError(
                f"SinkRotation: manager must be a BoundedKVManager, got {type(manager).__name__}; "
                f"for any flexkv cache use cache.rotation(layer_idx, rotary, mode)"
            )
        c = manager.config
        check_layer_index(layer_idx, c.num_layers, "SinkRotation: ")
        if not isinstance(rotary, Rotary):
            raise ValueError(f"SinkRotation: rotary must be a flexkv.cache.positions.rotary.Rotary, got {type(rotary).__name__}")
        if rotary.head_dim != c.head_dim:
            raise ValueError(
                f"SinkRotation: rotary.head_dim={rotary.head_dim} differs from the cache's head_dim={c.head_dim}"
            )
        if mode not in ROPE_POSITIONS:
            raise ValueError(f"SinkRotation: mode must be one of {ROPE_POSITIONS}, got {mode!r}")
        if mode == "cache":
            check_cache_config(c)
        # Not registered as submodules: the manager and the Rotary belong to the model.
        object.__setattr__(self, "manager", manager)
        object.__setattr__(self, "store", store)
        object.__setattr__(self, "rotary", rotary)
        self.layer_idx = layer_idx
        self.mode = mode
        self.rotated_inputs = bool(rotated_inputs)
        #: Which of its cache's rotaries this rotation turns by (`CacheGroup.rotation` numbers them): the key
        #: of the turns its step shares with the cache's other layers (`prepare`). None for a rotation built
        #: directly: its turns are shared by rotary identity eagerly and formed in each layer compiled.
        self.rotary_index = None
        lay = store.layout
        self._sink = c.sink_capacity
        self._slot_rows = c.max_slots * c.rows_per_request
        self._slots_base = lay.slots_base
        self._slot_row_len = lay.slot_row_len
        self._scratch_base = lay.scratch_base
        # Padding rows' sink cells (a cache without padding has no scratch and no such rows: never chosen).
        self._scratch_len = max(lay.scratch_len, 1)
        self._reverse = c.reverse_step_order
        self._query_window = c.query_window
        if mode == "cache" and self._sink:
            # Un-rotated sink keys of every slot row, plus one row that padding writes into.
            shape = ((self._slot_rows + 1) * self._sink, c.num_heads, c.head_dim)
            # Cache state, not model weights: kept out of the model's state_dict.
            self.register_buffer(
                "raw_sink", torch.zeros(shape, dtype=c.dtype, device=store.device), persistent=False
            )
            self.register_buffer(
                "_sink_offsets", torch.arange(self._sink, device=store.device).view(1, -1), persistent=False
            )

    def extra_repr(self) -> str:
        extra = ", rotated_inputs=True" if self.rotated_inputs else ""
        return f"layer_idx={self.layer_idx}, mode={self.mode!r}, sink={self._sink}{extra}"

    @property
    def memory_bytes(self) -> int:
        """Bytes of the un-rotated sink copies (0 in ``"stream"`` mode)."""
        raw = getattr(self, "raw_sink", None)
        return 0 if raw is None else raw.numel() * raw.element_size()

    @property
    def slot_bytes(self) -> int:
        """Bytes of the un-rotated sink copies one slot holds (0 in ``"stream"`` mode)."""
        raw = getattr(self, "raw_sink", None)
        return 0 if raw is None or not self._sink else self.memory_bytes // (raw.shape[0] // self._sink)

    def slot_buffers(self):
        """The per-slot buffers this rotation keeps (the un-rotated sink keys, ``"cache"`` mode), as
        `flexkv.cache.storage.slot_copy.SlotBuffer`s: a fork or reorder of the manager copies them too."""
        raw = getattr(self, "raw_sink", None)
        if raw is not None:
            yield SlotBuffer(raw, 0, 0, self._sink * self.manager.config.rows_per_request)

    def check_step(self, step: BoundedKVStep) -> None:
        """Host check (``"cache"`` mode): every query of each request must share one eviction count."""
        if self.mode == "cache":
            check_cache_step(self.manager.config, step)

    def forward(self, q: torch.Tensor, k: torch.Tensor, plan) -> Tuple[torch.Tensor, torch.Tensor]:
        """`q [N, Hq, T, D]`, `k [N, H, T, D]` -> both rotated at stream positions (see the class docstring)."""
        if self.rotated_inputs:
            if self.mode == "cache" and self._sink:
                self._rewrite_sinks(k, plan)
            return q, k
        pos = stream_positions(plan, k.shape[2], self._reverse)
        q = self.rotary.rotate(q, pos)
        k_raw = k
        k = self.rotary.rotate(k, pos)
        if self.mode == "cache" and self._sink:
            self._rewrite_sinks(k_raw, plan)
        return q, k

    def _slot_rows_of(self, plan) -> Tuple[torch.Tensor, torch.Tensor]:
        """Each plan row's slot row (padding rows: the spare row) and whether it is live."""
        return plan_slot_rows(plan, self._slots_base, self._slot_row_len, self._slot_rows)

    def sink_entries(self, plan) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's sink entries after `forward`: keys as kept (`[N, H, S, D]`, rotated at their stream
        index with `rotated_inputs`, else un-rotated; unquantized under quantized slots too), their values
        from the layer's cells (`[N, H, S, Dv]`, dequantized)
        and which exist in a live row (`[N, S]`, the retention's sink count; whether a query may read one
        yet is its position's business). ``"cache"`` mode with sinks only."""
        if self.mode != "cache" or not self._sink:
            raise ValueError(f"sink_entries: layer {self.layer_idx} keeps no sink copies (mode={self.mode!r}, "
                             f"sink={self._sink})")
        S = self._sink
        slot_row, cells, valid = self._shared(plan, ("sink_entries",), lambda: self._entry_cells(plan))
        N = slot_row.shape[0]
        H, D = self.raw_sink.shape[1:]
        keys = self.raw_sink.view(self._slot_rows + 1, S, H, D)[slot_row].transpose(1, 2)
        _, v_cells = self.store.layer_kv(self.layer_idx)  # [1, H, cells, Dv]
        values = v_cells[0][:, cells.view(-1)].view(H, N, S, -1).transpose(0, 1)
        v_scale = self.store.layer_scales(self.layer_idx)[1]
        if v_scale is not None:  # quantized slots: the values as their cells read back
            scale = v_scale[0][:, cells.view(-1)].view(H, N, S, 1).transpose(0, 1)
            values = dequantize(values, scale, self.manager.config.dtype)
        return keys, values, valid

    def rewrite_sinks(self, k: torch.Tensor, plan) -> None:
        """What `forward` does with `rotated_inputs` in ``"cache"`` mode, called directly: keep the step's sink
        keys `k` (rotated at stream positions) and rewrite the sink cells at in-cache positions."""
        if not (self.rotated_inputs and self.mode == "cache"):
            raise ValueError("rewrite_sinks: only for a 'cache' mode rotation built with rotated_inputs=True; "
                             "call the rotation as q, k = rotation(q, k, plan)")
        if self._sink:
            self._rewrite_sinks(k, plan)

    def _sink_geometry(self, plan) -> tuple:
        """Where a step's sink work goes, the same for every layer of the cache: the flat copy index of each
        own token (the spare row unless it lands in the sink region), each row's slot row, the sink cells
        `[N, S]` (padding rows: scratch cells) and the positions to rotate each copy at `[N, S]`."""
        S = self._sink
        N, T = plan.n.shape[0], plan.tokens
        pos = stream_positions(plan, T, self._reverse)
        sink_base = plan.sink_base.long()
        src_len = plan.src_len.long().view(-1, 1)
        slot_row, live = self._slot_rows_of(plan)
        # Own tokens that land in the sink region (the same cells attend writes them to; look-ahead ones
        # are overwritten later, as there).
        cell = pos - src_len
        store = live.view(-1, 1) & (cell >= 0) & (pos < plan.ring_start.long().view(-1, 1))
        flat = torch.where(store, slot_row.view(-1, 1) * S + cell.clamp(0, S - 1), self._slot_rows * S)
        if self._query_window is None:
            evicted = plan.lo.long() - plan.sink.long()
        else:
            evicted = (plan.n.long() - self._query_window - plan.sink.long()).clamp_min(0)
        offs = self._sink_offsets
        # A rotated input's copy already carries its own stream index (src_len + offs): only `e` is left.
        at = (evicted.view(-1, 1) + (0 if self.rotated_inputs else src_len + offs)).expand(N, S)
        cells = torch.where(
            live.view(-1, 1), sink_base.view(-1, 1) + offs, self._scratch_base + offs % self._scratch_len
        )
        return flat.view(N * T), slot_row, cells, at

    def _sink_turn(self, plan, dtype: torch.dtype):
        """How this rotation turns a row's sink copies (`[N, D, D]` matrices in at least float32 with rotated
        inputs, each row's copies turned alike; else cosines and sines `[N, S, 1, D]` in `dtype`)."""
        at = self._shared(plan, ("sink_geometry", self.rotated_inputs), lambda: self._sink_geometry(plan))[3]
        if self.rotated_inputs:
            # Every sink of a row turns by the same `e`: one `[D, D]` rotation matrix per row, so that a
            # layer's rotation is one batched matmul (`apply_rotary` is linear in x: `x @ M`, M = its
            # value on the identity).
            work = torch.promote_types(torch.float32, dtype)
            cos, sin = self.rotary.cos_sin(at[:, :1], work)  # [N, 1, D]
            eye = torch.eye(self.rotary.head_dim, dtype=work, device=cos.device)
            return apply_rotary(eye, cos, sin, self.rotary.layout)
        cos, sin = self.rotary.cos_sin(at, dtype)  # [N, S, D]
        return cos.unsqueeze(2), sin.unsqueeze(2)

    def _turn_key(self, dtype: torch.dtype) -> tuple:
        work = torch.promote_types(torch.float32, dtype) if self.rotated_inputs else dtype
        return ("sink_turn", self._rotary_key(), work, self.rotated_inputs)

    def _rotary_key(self):
        """This rotation's rotary in a shared part's key: the cache's number for it, else (a rotation built
        directly) its identity, eagerly only (`_shared` keeps no `id()` out of a graph)."""
        if self.rotary_index is not None:
            return self.rotary_index
        return None if torch.compiler.is_compiling() else ("id", id(self.rotary))

    def _entry_cells(self, plan) -> tuple:
        """Each plan row's slot row, its sink cells `[N, S]` and which of them a live row holds `[N, S]`."""
        slot_row, live = self._slot_rows_of(plan)
        offs = self._sink_offsets
        cells = torch.where(live.view(-1, 1), plan.sink_base.long().view(-1, 1) + offs, self._scratch_base)
        valid = live.view(-1, 1) & (offs < plan.sink.long().view(-1, 1))
        return slot_row, cells, valid

    def _query_turn(self, plan, dtype: torch.dtype) -> tuple:
        """Cosines and sines `[N, T, D]` in `dtype` that turn each query back by its own eviction count `e`
        (its in-cache distance to a sink is `e` less than its stream distance)."""
        pol = self.manager.config.retention_for(0)
        window = self._query_window if self._query_window is not None else pol.window
        pos = self.query_sinks(plan)[0]
        return self.rotary.cos_sin(-(pos - window - pol.sink).clamp_min(0), dtype)

    def _shared(self, plan, key: tuple, build):
        """What every layer of `plan`'s step reads alike under `key`: what `prepare` made with the plan (a
        compiled graph takes it as an input instead of forming it in every layer); else, eagerly, made by the
        first layer that needs it (`store.per_plan`), and compiled, formed in the graph."""
        ahead = plan.extras.get("sinks")
        found = None if ahead is None or None in key else ahead.get(key)
        if found is not None or torch.compiler.is_compiling():
            return build() if found is None else found
        memo = self.store.per_plan(plan)
        found = memo.get(key)
        if found is None:
            found = memo[key] = build()
        return found

    def prepare(self, plan) -> None:
        """Make with `plan` (on the host, by device ops on its tensors, before any layer runs) what every
        layer of its compiled step reads alike: the sink geometry, this rotation's turn of the sink copies
        and of each query, the sink entries' cells (`plan.extras["sinks"]`, keyed as `_shared` reads it)."""
        if self.mode != "cache" or not self._sink:
            return
        memo = plan.extras.setdefault("sinks", {})
        dtype = self.manager.config.dtype
        parts = {("sink_geometry", self.rotated_inputs): lambda: self._sink_geometry(plan),
                 self._turn_key(dtype): lambda: self._sink_turn(plan, dtype)}
        if plan.tokens > 1:  # what a chunk whose queries evicted different counts reads (never one token)
            parts.update({("sink_entries",): lambda: self._entry_cells(plan),
                          ("query_sinks",): lambda: self._query_sinks(plan),
                          ("query_turn", self._rotary_key(), dtype): lambda: self._query_turn(plan, dtype)})
        for key, build in parts.items():  # in order: each part's build reads the ones before it (`_shared`)
            if key not in memo:
                memo[key] = build()

    def _query_sinks(self, plan) -> tuple:
        pos = stream_positions(plan, plan.tokens, self._reverse)
        valid = self._shared(plan, ("sink_entries",), lambda: self._entry_cells(plan))[2]
        return pos, valid.unsqueeze(1) & (self._sink_offsets.view(1, 1, -1) <= pos.unsqueeze(-1))

    def query_sinks(self, plan) -> tuple:
        """`(positions [N, T], readable [N, T, S])`: each of the step's queries' stream position, and which
        sink entries it reads (kept in a live row, and not after it)."""
        return self._shared(plan, ("query_sinks",), lambda: self._query_sinks(plan))

    def query_turn(self, plan, dtype: torch.dtype) -> tuple:
        """`(cos, sin)` `[N, T, D]` turning each of the step's queries back by its own eviction count, as
        `apply_rotary` takes them (``"cache"`` mode with sinks)."""
        return self._shared(plan, ("query_turn", self._rotary_key(), dtype), lambda: self._query_turn(plan, dtype))

    def keep_sink_keys(self, k: torch.Tensor, plan) -> None:
        """Keep the step's own sink keys `k` (as `forward` takes them) without rewriting the sink cells: for
        a step that reads the sinks from their copies (`sink_entries`), not from the cells."""
        if self.mode == "cache" and self._sink:
            self._copy_sinks(k, plan)

    def _copy_sinks(self, k_raw: torch.Tensor, plan) -> tuple:
        N, H, T, D = k_raw.shape
        geometry = self._shared(plan, ("sink_geometry", self.rotated_inputs), lambda: self._sink_geometry(plan))
        flat = geometry[0]
        copies = torch.compiler.is_compiling() or self._shared(plan, ("sink_copies",), lambda: any(
            plan.field("n", i) < plan.field("ring_start", i) for i in range(plan.rows)))
        if copies:
            self.raw_sink.index_put_((flat,), k_raw.transpose(1, 2).reshape(N * T, H, D))
        return geometry

    def _rewrite_sinks(self, k_raw: torch.Tensor, plan) -> None:
        """Keep the step's own sink keys (as given) and rewrite every row's sink cells rotated `e` positions
        past their stream index. The geometry and the turn are made once per step and read by every layer
        (`_shared`: eagerly the first layer's; compiled, the plan's)."""
        S = self._sink
        N, H, T, D = k_raw.shape
        _, slot_row, cells, _ = self._copy_sinks(k_raw, plan)
        # Each row's copies as [N, S * H, D]: one row read whole per plan row.
        raw = self.raw_sink.view(self._slot_rows + 1, S * H, D).index_select(0, slot_row)
        turn = self._shared(plan, self._turn_key(k_raw.dtype), lambda: self._sink_turn(plan, k_raw.dtype))
        if self.rotated_inputs:
            rotated = torch.bmm(raw, turn.to(k_raw.dtype)).view(N, S, H, D)
        else:
            rotated = apply_rotary(raw.view(N, S, H, D), turn[0], turn[1], self.rotary.layout)
        if not torch.compiler.is_compiling() and self.store.config.slot_dtype is None:
            # One copy along the cell axis, into the cells-first view of the layer's keys (an advanced-index
            # write costs several times more per call).
            flat_cells = self._shared(plan, ("sink_cells",), lambda: cells.reshape(N * S))
            self.store.layer_kv(self.layer_idx)[0][0].transpose(0, 1).index_copy_(
                0, flat_cells, rotated.view(N * S, H, D))
        else:
            self.store.write_keys(self.layer_idx, cells.view(N, 1, S), rotated.transpose(1, 2))


def check_cache_config(config: BoundedKVConfig) -> None:
    """Raise `ValueError` unless ``"cache"`` rotary positions can be served for `config`.

    The sink entries must be written by each request: for every allowed
    source length `L`, `min(sink, L) == 0`.
    """
    for length, pol in config._resolved():
        if pol.sink and length:
            raise ValueError(
                f"rotary positions='cache' need the sink entries in the request's own slot, but "
                f"source_len={length} puts {min(pol.sink, length)} of the {pol.sink} sink entries in a shared "
                f"source; use positions='stream', or a retention with sink=0 for source_len > 0"
            )


def eviction_shared(config: BoundedKVConfig, step: BoundedKVStep) -> bool:
    """Whether every request's queries in `step` share one eviction count (what `check_cache_step` asks)."""
    try:
        check_cache_step(config, step)
    except ValueError:
        return False
    return True


def check_cache_step(config: BoundedKVConfig, step: BoundedKVStep) -> None:
    """Raise `ValueError` if a request's queries in `step` would need different eviction counts.

    Only possible with a per-query window: query `t` of a stream at length
    `n` has evicted `max(0, n + t - query_window - sink)` entries.
    """
    qw = config.query_window
    T = step.step_tokens
    if qw is None or T == 1:
        return
    for seg in step.segments:
        if seg.request_id is None:
            continue
        pos = step.positions[seg.request_id]
        sink = config.retention_for(pos.source_len).sink
        n = pos.length
        if n + T - 1 - qw - sink > 0:
            raise ValueError(
                f"request {seg.request_id!r}: rotary positions='cache' with query_window={qw} need one eviction "
                f"count per step, but a step of T={T} tokens at stream length n={n} (sink={sink}) has queries "
                f"past n + T - 1 = {n + T - 1} > query_window + sink = {qw + sink}; run such steps one token at "
                f"a time (T=1) or use positions='stream'"
            )

