"""Fixed-size per-stream state of a model's recurrent layers (linear attention, Mamba, short convolutions).

Hybrid models (Qwen3-Next, Granite 4, Bamba, Jamba, Falcon-H1, LFM2,
MiniMax, Kimi Linear) mix attention layers with layers whose whole memory of
a stream is a fixed-size state: a convolution window of the last few inputs
and, in most, a recurrent matrix. transformers keeps those in
`LinearAttentionCacheLayerMixin` layers (`update_conv_state`,
`update_recurrent_state`; MiniMax: `set_linear_cache`). `RecurrentStates`
keeps the same states for every slot of a `FlexKVCache`, in buffers
allocated once, `[max_streams, *state shape]` per layer and state:

* `read(forward, layer, kind, index)` gathers the forward's rows from their
  slots (zeros for streams that start in it), or None when every row starts
  a stream (as the model's own cache answers before its first forward);
* `write...` stages what the layer computed (a decode step's in-place update
  of the gathered tensor is staged by the read itself);
* `commit(forward)` copies the staged states into the rows' slots once the
  forward has returned; a forward that fails leaves every slot as it was.

The state shapes and dtypes are the model's own: `probe(model)` runs the
model once on one token with the cache it builds for itself and reads them
off that cache.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from ...config import resolve_device

__all__ = ["RecurrentStates", "probe_states", "check_recurrent_forward"]

StateKey = Tuple[int, str, int]  # (model layer, kind, state index)


def probe_states(model) -> Dict[StateKey, tuple]:
    """`{(layer, kind, index): (shape without the batch dim, dtype)}` of every recurrent state the model keeps.

    Runs the model once on one token of batch 1 with the cache it builds for
    itself (`use_cache=True`, no cache given), and reads the states off that
    cache: whatever its recurrent layers allocate, in the dtype they allocate
    it (often float32 in a bfloat16 model).
    """
    probe = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):  # no graph compiled for a probe
        out = model(input_ids=probe, use_cache=True)
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    found: Dict[StateKey, tuple] = {}
    for layer, entry in enumerate(getattr(cache, "layers", ()) or ()):
        for kind, store in (("conv", getattr(entry, "conv_states", None)),
                            ("recurrent", getattr(entry, "recurrent_states", None))):
            for index, t in (store or {}).items():
                if isinstance(t, torch.Tensor):
                    found[(layer, kind, index)] = (tuple(t.shape[1:]), t.dtype)
    for layer, t in enumerate(getattr(cache, "linear_cache", ()) or ()):  # MiniMax's own cache
        if isinstance(t, torch.Tensor):
            found[(layer, "recurrent", 0)] = (tuple(t.shape[1:]), t.dtype)
    return found


class RecurrentStates:
    """Every slot's recurrent-layer states, one buffer `[max_streams, *shape]` per layer, kind and index."""

    def __init__(self, shapes: Dict[StateKey, tuple], max_streams: int, device):
        self.shapes = dict(shapes)
        self.max_streams = max_streams
        self.device = resolve_device(device)
        self.buffers: Dict[StateKey, torch.Tensor] = {
            key: torch.zeros((max_streams, *shape), dtype=dtype, device=self.device)
            for key, (shape, dtype) in self.shapes.items()
        }
        self.layers = tuple(sorted({key[0] for key in self.shapes}))

    def holds(self, layer: int) -> bool:
        return layer in self.layers

    @property
    def memory_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    @property
    def slot_bytes(self) -> int:
        """Bytes one stream's states hold over every recurrent layer."""
        return self.memory_bytes // self.max_streams

    def layer_bytes(self, layer: int) -> int:
        """Bytes one stream's states hold in one layer."""
        return sum(b[0].numel() * b.element_size() for key, b in self.buffers.items() if key[0] == layer)

    def _buffer(self, layer: int, kind: str, index: int) -> torch.Tensor:
        buf = self.buffers.get((layer, kind, index))
        if buf is None:
            held = sorted(k for k in self.buffers if k[0] == layer)
            raise ValueError(
                f"layer {layer} asked for its {kind} state {index}, but when the cache was built the model kept "
                f"only {held or 'no states'} there; the model's recurrent layers changed since the cache was built"
            )
        return buf

    def clear(self, slots: torch.Tensor) -> None:
        """Zero the states of `slots` (streams that start now)."""
        with torch.no_grad():
            for buf in self.buffers.values():
                buf.index_fill_(0, slots, 0)

    def read(self, forward, layer: int, kind: str, index: int):
        """The rows' states for the forward (staged if the layer already wrote them), or None if no row continues."""
        key = (layer, kind, index)
        staged = forward.staged.get(key)
        if staged is not None:
            return staged
        buf = self._buffer(layer, kind, index)
        if not forward.continues:
            return None
        # A fresh tensor of the rows' states: a decode step updates it in place (transformers'
        # fused conv and selective-state updates), which is why it is staged as it is handed out.
        rows = buf.index_select(0, forward.state_slots)
        forward.staged[key] = rows
        return rows

    def write(self, forward, layer: int, kind: str, index: int, value: torch.Tensor) -> torch.Tensor:
        """Stage a state the layer computed; committed to the rows' slots when the forward returns."""
        buf = self._buffer(layer, kind, index)
        want = (forward.state_slots.shape[0], *buf.shape[1:])
        if tuple(value.shape) != want or value.dtype != buf.dtype:
            raise ValueError(
                f"layer {layer} wrote a {kind} state {tuple(value.shape)} {value.dtype}; the cache holds "
                f"{want} {buf.dtype} for it (the shape and dtype the model used when the cache was built)"
            )
        forward.staged[(layer, kind, index)] = value
        return value

    def write_conv(self, forward, layer: int, index: int, conv_input: torch.Tensor) -> torch.Tensor:
        """transformers' `update_conv_state`: stage the last `K` columns of the convolution's input, and
        return the whole input the layer convolves (the previous `K` columns, then this forward's)."""
        buf = self._buffer(layer, "conv", index)
        K = buf.shape[-1]
        prev = self.read(forward, layer, "conv", index)
        if prev is None:
            full = conv_input
            if full.shape[-1] < K:
                full = torch.nn.functional.pad(full, (K - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([prev, conv_input], dim=-1)
        self.write(forward, layer, "conv", index, full[..., -K:].to(buf.dtype))
        return full

    def commit(self, forward) -> None:
        """Copy the forward's staged states into its rows' slots (it returned)."""
        if not forward.staged:
            return
        with torch.no_grad():
            for key, value in forward.staged.items():
                self.buffers[key].index_copy_(0, forward.state_slots, value)
        forward.staged = {}

    def report(self, layer_types) -> tuple:
        """One dict per kind of recurrent layer: its layers, the states one stream keeps there, and bytes."""
        by_type: dict = {}
        for layer in self.layers:
            by_type.setdefault(layer_types[layer], []).append(layer)
        out = []
        for name, layers in by_type.items():
            states = tuple(
                (kind, index, shape, dtype)
                for (layer, kind, index), (shape, dtype) in sorted(self.shapes.items(), key=lambda kv: kv[0])
                if layer == layers[0]
            )
            slot = sum(self.layer_bytes(layer) for layer in layers)
            out.append(dict(name=name, layers=tuple(layers), states=states, slot_bytes=slot,
                            memory_bytes=slot * self.max_streams))
        return tuple(out)


def check_recurrent_forward(layers, restarts, rows, written, real, T: int) -> None:
    """Refuse a forward the recurrent `layers` cannot compute exactly (before anything changes).

    `rows`: each batch row's stream, `written` its length, `real` each row's token columns (None:
    no padding), `T` the forward's columns; `restarts`: why a multi-token forward would restart a
    mixer's state (empty: none does).
    """
    if real is not None:
        for sid, w, r in zip(rows, written, real):
            if len(r) == T:
                continue
            leading = r == list(range(T - len(r), T))
            if w == 0 and leading:
                continue
            where = "continues a stream that holds {} tokens".format(w) if w else "comes after its tokens"
            raise ValueError(
                f"stream {sid!r}: this forward has {T - len(r)} padding column(s) for it and its padding {where}; "
                f"the recurrent layers {layers} advance their state on every column, so padding is exact only "
                f"before the first token of a new stream (left padding of new streams). Feed a continuing "
                f"stream without padding: one stream per call (cache.select([{sid!r}])), or streams whose new "
                f"tokens have the same length"
            )
    if restarts and T > 1:
        going = [sid for sid, w in zip(rows, written) if w]
        if going:
            raise ValueError(
                f"streams {going} continue with {T} tokens in one forward, but {restarts[0]} (layers "
                f"{layers}): continue a stream one token per forward (its prompt may be any length)"
            )
