"""Retention policies and the cache configuration.

`BoundedKVConfig` is the whole static description of a cache: model shape,
how many requests it holds, and which entries of each request's stream it
keeps. Everything here is plain Python; nothing touches a device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Union

import torch

__all__ = ["SinkWindow", "Recall", "BoundedKVConfig", "SUPPORTED_DTYPES", "SLOT_DTYPES", "is_int", "check_config", "check_layer_index"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: Cell dtypes of a quantized cache (`BoundedKVConfig.slot_dtype`; `flexkv.cache.storage.quantized` stores them).
SLOT_DTYPES = (torch.int8, torch.float8_e4m3fn)


def resolve_device(device) -> torch.device:
    """`device` as the device its tensors report: a bare "cuda" names the current CUDA device's index
    ("cuda:0"), so a cache built on "cuda" accepts the tensors a model made there."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def is_int(x) -> bool:
    """Whether `x` is an integer (a Python int that is not a bool): the one test every check uses."""
    return type(x) is int or (isinstance(x, int) and not isinstance(x, bool))


def _int(name: str, value, lo: int, hint: str = "") -> int:
    """Check that `value` is an int >= lo; return it, or raise naming it."""
    if not is_int(value):
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r} ({type(value).__name__}){hint}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}{hint}")
    return value


class _SinkWindowFields(NamedTuple):
    sink: int
    window: int
    window_includes_step: bool = False


class SinkWindow(_SinkWindowFields):
    """Keep the stream's first `sink` entries and its last `window` entries.

    `window` counts the entries *before* the step's own tokens: a decode
    query attends `sink` sinks, the `window` entries before it, and itself.
    `window_includes_step=True` counts the step's written tokens against the
    window: a step writing `span` tokens reads only the last `window - span`
    retained entries (none when that is <= 0).

    A model whose `context=C` means "C keys, the query included" (a ring
    of C entries) is `SinkWindow.keys(C, sink)`, not `SinkWindow(sink, C)`,
    which would give every query one key more (docs/models.md, "Conventions").

    A named tuple (`sink, window, includes = policy`, `policy[1]`,
    `policy._replace(window=...)`) whose construction checks its values:
    `SinkWindow(...)`, `_make` and `_replace` all raise `ValueError` naming a
    bad value.
    """

    __slots__ = ()

    def __new__(cls, sink: int, window: int, window_includes_step: bool = False):
        _int("SinkWindow.sink", sink, 0)
        _int("SinkWindow.window", window, 0)
        if not isinstance(window_includes_step, bool):
            raise ValueError(
                f"SinkWindow.window_includes_step must be a bool, got {window_includes_step!r}"
            )
        return super().__new__(cls, sink, window, window_includes_step)

    @classmethod
    def keys(cls, context: int, sink: int = 0) -> "SinkWindow":
        """The retention of a model whose `context` counts keys *with* the query (a ring of
        `context` entries), plus `sink` attention sinks.

        `SinkWindow(sink, context, window_includes_step=True)`: a step writing
        `span` tokens reads the last `context - span` entries before it, so
        the step's last written token attends exactly `context` keys, itself
        included. For decode (`T = 1`) that is `window = context - 1` entries
        before the query. For chunks of `T` written tokens, give the layer
        `causal_step=True` as well (`BoundedKVConfig`, `LayerGroup`): each
        query then attends the last `context` entries before the chunk's end
        up to itself, as a ring cache of `context` entries does.
        """
        if not is_int(context) or context < 1:
            raise ValueError(
                f"SinkWindow.keys: context must be an int >= 1 (keys a query attends, itself included), "
                f"got {context!r}"
            )
        return _RingKeys(sink, context, True)

    @property
    def ring_keys(self) -> Optional[int]:
        """`C` for a policy built as `SinkWindow.keys(C, sink)` (a ring of `C` keys, the query included),
        else None. A cache that feeds such a policy chunks must attend them causally, as a ring does
        (`causal_step=True`); `BoundedKVConfig` refuses chunks attended whole under it."""
        return None

    @classmethod
    def _make(cls, iterable) -> "SinkWindow":
        # namedtuple's own _make (and so _replace) builds the tuple directly; validate through __new__.
        return cls(*iterable)

    def window_start(self, n: int, span: int) -> int:
        """First stream index of the window for a step at stream length `n`.

        Retained entries `j < n` are read when `j < sink` or `j >= lo`; the
        result is never below `sink`, and equals `max(sink, n)` when the
        window is empty.
        """
        w = self.window - span if self.window_includes_step else self.window
        return max(self.sink, n - max(w, 0))


class _RingKeys(SinkWindow):
    """What `SinkWindow.keys(C, sink)` returns: the same tuple, remembering that it is a ring of `C` keys."""

    __slots__ = ()

    @property
    def ring_keys(self) -> Optional[int]:
        return self.window if self.window_includes_step else None

    def __repr__(self):
        if not self.window_includes_step:
            return f"SinkWindow(sink={self.sink}, window={self.window})"
        return f"SinkWindow.keys({self.window}, sink={self.sink})"


class Recall(SinkWindow):
    """Sinks and a window as `SinkWindow(sink, window)`, plus a memory of what left the window.

    Entries after the sinks fall into blocks of `block` stream entries (block
    `b` holds entries `sink + b * block` to `sink + (b + 1) * block - 1`).
    For a query whose first window entry is `w` (`p - query_window` under a
    per-query window, the step's window start otherwise; at least `sink`),
    the blocks wholly before `w` are `0 .. B - 1` with `B = (w - sink) //
    block`; its memory is the newest `memory // block` of them (first in,
    first out), and its tail the entries `sink + B * block .. w - 1` that
    left the window while their block is not yet whole. Each query reads its
    sinks, its window, its tail, and those of its memory blocks that the
    step chose for its KV head:

    - every step, per row and KV head, the blocks in some writing query's
      memory are scored `sum over the step's written tokens t and the head's
      query heads h of q[h, t] . mean(k[block])`, the mean over the block's
      `block` keys; the `top_k` highest are chosen (all of them when fewer;
      ties go to the lower block).

    A decode step's selection is its one query's; the queries of a chunk
    choose together (InfLLM's chunk-level lookup). The footprint is fixed at
    admission: a slot keeps `memory + block - 1` more cells of each layer's
    ring (`BoundedKVConfig.ring_cells`) and one mean key per block the ring
    can hold (`slot_bytes` counts both). Under in-cache rotary positions
    (`positions="cache"`, `SinkRotation`) a memory or tail entry is read at
    the position just before the step's first window entry, so no distance
    passes `window + step`.

    A named tuple of five fields (`sink, window, memory, block, top_k`); it
    is a `SinkWindow` for everything that plans sinks and windows
    (`policy.sink`, `policy.window`, `window_includes_step` is False).
    """

    __slots__ = ()
    _fields = ("sink", "window", "memory", "block", "top_k")

    def __new__(cls, sink: int, window: int, memory: int, block: int = 64, top_k: int = 4):
        _int("Recall.sink", sink, 0)
        _int("Recall.window", window, 0)
        _int("Recall.block", block, 1)
        _int("Recall.memory", memory, block, f" (at least one block of block={block} entries)")
        if memory % block:
            raise ValueError(
                f"Recall.memory must be a whole number of blocks of block={block} entries, got {memory}; "
                f"use memory={memory // block * block or block} or {(memory // block + 1) * block}"
            )
        _int("Recall.top_k", top_k, 1)
        if top_k > memory // block:
            raise ValueError(
                f"Recall.top_k must be at most memory // block = {memory // block} (the blocks the memory "
                f"holds), got {top_k}; raise memory or lower top_k"
            )
        return tuple.__new__(cls, (sink, window, False, memory, block, top_k))

    memory = property(lambda self: tuple.__getitem__(self, 3), doc="Entries kept after they leave the window.")
    block = property(lambda self: tuple.__getitem__(self, 4), doc="Stream entries per memory block.")
    top_k = property(lambda self: tuple.__getitem__(self, 5), doc="Memory blocks each row and KV head attends.")

    def __getnewargs__(self):
        return (self.sink, self.window, self.memory, self.block, self.top_k)

    def _asdict(self) -> dict:
        return dict(zip(self._fields, self.__getnewargs__()))

    @classmethod
    def _make(cls, iterable) -> "Recall":
        return cls(*iterable)

    def _replace(self, **changes) -> "Recall":
        unknown = set(changes) - set(self._fields)
        if unknown:
            raise ValueError(f"Recall._replace: no field(s) {sorted(unknown)}; the fields are {self._fields}")
        return Recall(**{**self._asdict(), **changes})

    @property
    def window_part(self) -> SinkWindow:
        """`SinkWindow(sink, window)`: what every query reads besides its memory blocks."""
        return SinkWindow(self.sink, self.window)

    @property
    def memory_blocks(self) -> int:
        """Blocks the memory holds when full: `memory // block`."""
        return self.memory // self.block

    def __repr__(self):
        return (f"Recall(sink={self.sink}, window={self.window}, memory={self.memory}, block={self.block}, "
                f"top_k={self.top_k})")


Retention = Union[SinkWindow, Callable[[int], SinkWindow]]


@dataclass(frozen=True)
class BoundedKVConfig:
    """Static description of one bounded KV cache (docs/contract.md section 4).

    `retention` is one `SinkWindow` for every request, or a callable
    `source_len -> SinkWindow` that is resolved once here for every length in
    `[min_source_len, max_source_len]`. Construction validates every field and
    raises `ValueError` naming the offending value and the allowed range.

    `head_dim` is the width of a key (and of each query head);
    `value_head_dim` the width of a value, None (the default) meaning the
    same: the config resolves it to `head_dim` when built, so
    `config.value_head_dim` is always an int, and `replace(head_dim=...)` on a
    config given no value width moves both. They differ in multi-head latent
    attention (DeepSeek-V2/V3: keys carry a rotary part that values do not).

    `causal_step=True` makes a per-step window causal inside the step: every
    query attends the step's shared window (sinks and the entries from
    `window_start`) and the step's own tokens up to itself, none after it
    (contract section 2). It needs stream order and a per-step window.

    `slot_dtype` stores the cache's key and value cells quantized: `torch.int8`
    or `torch.float8_e4m3fn`, each cell with a float32 scale per head
    (`flexkv.cache.storage.quantized`); None (the default) keeps cells in `dtype`.
    Queries, keys and values still enter and leave `attend` in `dtype`. On
    the CPU choose int8: it is the more accurate of the two and steps over it
    run within 1.25x of unquantized ones (compiled decode about twice as
    fast), where float8 cells, which the CPU widens slowly, cost 1.3-1.7x
    (docs/benchmarks.md, "Quantized slots").

    `max_rollback` is how many of its last committed tokens a request may
    take back (`rollback_request`; speculative decoding's rejected draft
    tokens). A slot's ring keeps `max(max_step_tokens, max_rollback)` cells
    beyond the window (`ring_cells`), so a rollback of that many tokens right
    after a step finds every entry the retention needs intact; 0 (the default)
    keeps the ring as it is, which already allows rollbacks up to
    `max_step_tokens` (contract section 5, "Fork and roll back").

    `padding_segments` says whether a step may carry padding segments
    (`Segment(None, 0)`: rows of no request, which an engine or a session
    uses to keep a step's shape fixed). They write into `max_step_tokens`
    scratch cells per layer that nothing reads. A cache whose steps never
    pad (transformers' `FlexKVCache`: every row of its batch is a stream)
    gives False and holds no scratch cells; a step with a padding segment is
    then refused.
    """

    num_layers: int
    num_heads: int
    head_dim: int
    rows_per_request: int
    max_source_len: int
    retention: Retention
    max_slots: int = 32
    min_source_len: int = 0
    dtype: Optional[torch.dtype] = torch.float32
    reverse_step_order: bool = False
    query_window: Optional[int] = None
    max_step_tokens: int = 1
    max_sources: int = 1
    value_head_dim: Optional[int] = None
    causal_step: bool = False
    slot_dtype: Optional[torch.dtype] = None
    max_rollback: int = 0
    padding_segments: bool = True
    _policies: tuple = field(default=(), init=False, repr=False, compare=False)
    #: True when no value width was given: values are as wide as keys, through `replace` too
    _values_as_keys: bool = field(default=False, init=False, repr=False, compare=False)
    #: The `Recall` among the resolved policies, or None (read on every `attend`: settled once here)
    _recall: Optional["Recall"] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        _int("num_layers", self.num_layers, 1)
        _int("num_heads", self.num_heads, 1)
        _int("head_dim", self.head_dim, 1)
        if self.value_head_dim is None:
            object.__setattr__(self, "_values_as_keys", True)
            object.__setattr__(self, "value_head_dim", self.head_dim)
        _int("value_head_dim", self.value_head_dim, 1, " (or None for the same width as head_dim)")
        _int("rows_per_request", self.rows_per_request, 1)
        _int("max_source_len", self.max_source_len, 0)
        _int("max_slots", self.max_slots, 1)
        _int("min_source_len", self.min_source_len, 0)
        if self.min_source_len > self.max_source_len:
            raise ValueError(
                f"min_source_len must be in [0, max_source_len={self.max_source_len}], "
                f"got {self.min_source_len}"
            )
        _int("max_step_tokens", self.max_step_tokens, 1)
        _int("max_sources", self.max_sources, 0)
        _int("max_rollback", self.max_rollback, 0,
             " (the most committed tokens a request may take back; 0 allows up to max_step_tokens)")
        if self.max_source_len > 0 and self.max_sources == 0:
            raise ValueError(
                f"max_sources must be >= 1 when max_source_len > 0 (got max_sources=0, "
                f"max_source_len={self.max_source_len}); set max_source_len=0 for a cache without sources"
            )
        if self.dtype is not None and self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES} or None, got {self.dtype!r}")
        if self.slot_dtype is not None and self.slot_dtype not in SLOT_DTYPES:
            names = ", ".join(f"torch.{str(d).split('.')[-1]}" for d in SLOT_DTYPES)
            raise ValueError(
                f"slot_dtype must be one of {names} (cells quantized with a scale per cell and head) or None "
                f"(cells in the cache's dtype), got {self.slot_dtype!r}; use dtype= for an unquantized cache in "
                f"another floating type"
            )
        for name in ("reverse_step_order", "causal_step", "padding_segments"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.causal_step and self.reverse_step_order:
            raise ValueError(
                "causal_step=True needs stream order (a query sees the step's tokens before it), but "
                "reverse_step_order=True writes the step last-first; use one or the other"
            )
        if self.causal_step and self.query_window is not None:
            raise ValueError(
                f"causal_step=True is a per-step window causal inside the step, but query_window="
                f"{self.query_window} asks for a per-query window (causal already); give query_window=None "
                f"with causal_step=True, or query_window alone"
            )

        policies = []
        for length in range(self.min_source_len, self.max_source_len + 1):
            pol = self.retention if isinstance(self.retention, SinkWindow) else (
                self.retention(length) if callable(self.retention) else self.retention)
            if not isinstance(pol, SinkWindow):
                raise ValueError(
                    f"retention must be a SinkWindow or a callable returning one; for source_len={length} "
                    f"it gave {pol!r}"
                )
            policies.append(pol)
        object.__setattr__(self, "_policies", tuple(policies))
        recalls = {p for p in policies if isinstance(p, Recall)}
        if recalls and (len(recalls) > 1 or len(recalls) != len(set(policies))):
            raise ValueError(
                f"a Recall retention keeps one memory for every stream: give retention=Recall(...) itself, not a "
                f"callable whose policies differ by source length (got {sorted(set(map(repr, policies)))})"
            )
        if recalls and self.max_source_len > 0:
            raise ValueError(
                f"retention {policies[0]!r} keeps its memory in the slot's ring, which a source's entries never "
                f"enter: give max_source_len=0 (got {self.max_source_len}), or SinkWindow for a cache with sources"
            )
        if recalls and self.reverse_step_order:
            raise ValueError(f"retention {policies[0]!r} needs stream order: got reverse_step_order=True")
        object.__setattr__(self, "_recall", next(iter(recalls)) if recalls else None)

        qw = self.query_window
        if qw is None and not self.causal_step and self.max_step_tokens > 1:
            for length, pol in self._resolved():
                C = pol.ring_keys
                if C is not None:
                    raise ValueError(
                        f"retention {pol!r} (source_len={length}) is a ring of {C} keys, the query included, but "
                        f"max_step_tokens={self.max_step_tokens} with a per-step window attends each chunk whole: "
                        f"every frame of a chunk would see the chunk's later frames and keys a ring of {C} has "
                        f"already overwritten (against a ring cache it is silently off). Give causal_step=True "
                        f"(chunks written into the ring, then attended causally: what a ring cache does), or "
                        f"query_window={C - 1} with SinkWindow({pol.sink}, {C - 1}) (each frame attends what it would "
                        f"alone); if each chunk really attends the whole window and the whole chunk, write the "
                        f"policy as SinkWindow({pol.sink}, {C}, window_includes_step=True)"
                    )
        if qw is not None:
            _int("query_window", qw, 0, " (or None for a per-step window)")
            if self.reverse_step_order:
                raise ValueError(
                    "query_window needs stream order: got reverse_step_order=True with "
                    f"query_window={qw}; use one or the other"
                )
            for length, pol in self._resolved():
                if pol.window_includes_step:
                    raise ValueError(
                        f"query_window={qw} cannot be combined with window_includes_step=True "
                        f"(source_len={length}: {pol})"
                    )
                if pol.window < qw:
                    raise ValueError(
                        f"query_window={qw} needs window >= {qw} for every source length, "
                        f"but source_len={length} has window={pol.window}"
                    )

    def _resolved(self):
        return zip(range(self.min_source_len, self.max_source_len + 1), self._policies)

    def retention_for(self, source_len: int) -> SinkWindow:
        """The resolved policy for a stream that starts with `source_len` source entries."""
        if not is_int(source_len) or not (
            self.min_source_len <= source_len <= self.max_source_len
        ):
            raise ValueError(
                f"source_len must be an int in [min_source_len={self.min_source_len}, "
                f"max_source_len={self.max_source_len}], got {source_len!r}"
            )
        return self._policies[source_len - self.min_source_len]

    @property
    def sink_capacity(self) -> int:
        """Written entries a slot's sink region holds: max(sink - source_len, 0) over lengths."""
        return max(max(p.sink - length, 0) for length, p in self._resolved())

    @property
    def window_capacity(self) -> int:
        """The largest window over every allowed source length."""
        return max(p.window for p in self._policies)

    @property
    def max_retained(self) -> int:
        """The largest sink + window over every allowed source length."""
        return max(p.sink + p.window for p in self._policies)

    @property
    def recall(self) -> Optional[Recall]:
        """The `Recall` retention this cache keeps (its memory lies in each slot's ring), or None."""
        return self._recall

    @property
    def memory_capacity(self) -> int:
        """Ring cells a slot keeps for entries that left the window: a `Recall`'s whole blocks (`memory`)
        and the fewer than `block` entries of the block leaving the window; 0 without one."""
        recall = self.recall
        return 0 if recall is None else recall.memory + recall.block - 1

    @property
    def ring_cells(self) -> int:
        """Cells of a slot row's ring: the largest window, the memory of a `Recall` retention
        (`memory_capacity`), plus `max(max_step_tokens, max_rollback)` cells a step writes into
        before it attends and a rollback reads back."""
        return self.window_capacity + self.memory_capacity + max(self.max_step_tokens, self.max_rollback)

    @property
    def slot_tokens(self) -> int:
        """Entries a slot row keeps between steps: sink_capacity + window_capacity."""
        return self.sink_capacity + self.window_capacity

    def replace(self, **changes) -> "BoundedKVConfig":
        """A copy with some fields changed (validated again). A config built without a value width
        keeps values as wide as keys: `replace(head_dim=32)` makes both 32."""
        if self._values_as_keys and "value_head_dim" not in changes:
            changes["value_head_dim"] = None
        return dataclasses.replace(self, **changes)


def check_config(config, name: str = "config") -> BoundedKVConfig:
    """Return `config` if it is a `BoundedKVConfig`, else raise naming `name` and what it got."""
    if not isinstance(config, BoundedKVConfig):
        raise ValueError(f"{name} must be a BoundedKVConfig, got {type(config).__name__}")
    return config


def check_layer_index(layer_idx, num_layers: int, where: str = "") -> int:
    """Return `layer_idx` if it is an int in `[0, num_layers)`, else raise (`where` prefixes the message).

    Under `torch.compile` the index may be a symbolic int, which cannot be
    formatted: the message then says only that it is out of range.
    """
    if is_int(layer_idx) and 0 <= layer_idx < num_layers:
        return layer_idx
    got = "an index outside that range" if torch.compiler.is_compiling() else repr(layer_idx)
    raise ValueError(f"{where}layer_idx must be an int in [0, {num_layers}), got {got}")
