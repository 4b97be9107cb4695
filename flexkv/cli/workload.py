"""Streaming workloads: the static description of one streaming use of the cache.

A `Workload` (model shape, retention, step shape, batch, run length) is read
from a YAML file by `load_workload` (checked field by field) or taken from
`BUILTIN`; `Workload.config()` gives the `BoundedKVConfig` of its cache.
What runs from it lives beside it: `flexkv.cli.stream_model.StreamModel` (the
attention model) and `flexkv.cli.traffic.Traffic` (seeded arrivals and
departures). Nothing here times or checks anything; `flexkv.cli.runner` does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..cache.storage.quantized import SLOT_DTYPE_NAMES, cell_bytes, slot_dtype_named
from ..config import BoundedKVConfig, Recall, SinkWindow, is_int

__all__ = [
    "Workload",
    "WorkloadError",
    "BUILTIN",
    "load_workload",
    "parse_workload",
]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
COMPILE_MODES = ("layer", "graph")
SCORE_BIAS = ("none", "relative")


class WorkloadError(ValueError):
    """A workload description (YAML file or field) is invalid; the message says which value and why."""


@dataclass(frozen=True)
class Workload:
    """One streaming workload. Field names are the YAML keys.

    Model: `layers`, `kv_heads` x `head_dim` keys, `q_heads` query heads
    (a multiple of `kv_heads`: grouped-query attention when larger), `rows`
    rows per request (2 for batched classifier-free guidance).
    Retention: `source_len` entries of a shared source (0: none; `sources`
    distinct ones, each request picks one), `sink`, `window`,
    `window_includes_step`, `query_window`, `reverse_step_order` (docs/contract.md sections 1-2);
    `memory` > 0 keeps that many entries past the window, `memory_block` per block, and attends each
    step's `top_k` best-scoring blocks (`flexkv.Recall`; 0, the default: sinks and window only).
    Step: each request writes `span` tokens per step out of `tokens` (T);
    with `final_tokens`, a request ends with one step of `final_tokens`
    tokens that writes `final_span`. `score_bias: relative` adds a learned
    relative-position bias on in-cache positions.
    Run: `requests` batch lanes (also the cache's `max_slots`); each request
    writes a seeded number of tokens in `stream_len` = [low, high] and leaves;
    an empty lane takes a new request with probability `arrival` per step;
    `steps` model steps; `seed`; `block_size` (FlexAttention KV block; omit it and flexkv picks one);
    `compile` (`layer`: one compiled function per layer, `graph`: the whole
    step as one graph); `check_steps` steps checked against the float64
    reference for up to `check_requests` tracked requests. `dtype`: the
    model's; `slot_dtype`: how the cache stores its cells (`none`, or `int8` /
    `fp8` for quantized slots, `flexkv.cache.storage.quantized`).
    """

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    window: int
    description: str = ""
    q_heads: Optional[int] = None
    rows: int = 1
    source_len: int = 0
    sources: int = 1
    sink: int = 0
    window_includes_step: bool = False
    query_window: Optional[int] = None
    reverse_step_order: bool = False
    memory: int = 0
    memory_block: int = 64
    top_k: int = 4
    span: int = 1
    tokens: Optional[int] = None
    final_tokens: Optional[int] = None
    final_span: int = 0
    score_bias: str = "none"
    requests: int = 8
    stream_len: Tuple[int, int] = (0, 0)
    arrival: float = 0.5
    steps: int = 200
    seed: int = 0
    block_size: Optional[int] = None
    compile: str = "layer"
    check_steps: int = 3
    check_requests: int = 2
    dtype: str = "float32"
    slot_dtype: str = "none"

    def __post_init__(self):
        _check_fields(self)

    # ------------------------------------------------------------ derived

    @property
    def num_q_heads(self) -> int:
        return self.kv_heads if self.q_heads is None else self.q_heads

    @property
    def step_tokens(self) -> int:
        """T of a regular step."""
        return self.span if self.tokens is None else self.tokens

    @property
    def max_tokens(self) -> int:
        """The largest T of any step (regular or final)."""
        return max(self.step_tokens, self.final_tokens or 0)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def d_model(self) -> int:
        """Hidden size of the model: kv_heads * head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def entry_bytes(self) -> int:
        """Bytes one stream entry takes over every layer and row, keys and values."""
        cell = cell_bytes(self.head_dim, self.torch_dtype, slot_dtype_named(self.slot_dtype))
        return 2 * self.layers * self.rows * self.kv_heads * cell

    def retention(self) -> SinkWindow:
        if self.memory:
            return Recall(self.sink, self.window, self.memory, self.memory_block, self.top_k)
        return SinkWindow(self.sink, self.window, self.window_includes_step)

    def config(self) -> BoundedKVConfig:
        """The cache configuration this workload runs on (`max_slots = requests`)."""
        return BoundedKVConfig(
            num_layers=self.layers,
            num_heads=self.kv_heads,
            head_dim=self.head_dim,
            rows_per_request=self.rows,
            max_source_len=self.source_len,
            min_source_len=self.source_len,
            retention=self.retention(),
            max_slots=self.requests,
            dtype=self.torch_dtype,
            reverse_step_order=self.reverse_step_order,
            query_window=self.query_window,
            max_step_tokens=self.max_tokens,
            max_sources=self.sources if self.source_len else 0,
            slot_dtype=slot_dtype_named(self.slot_dtype),
        )

    def replace(self, **changes) -> "Workload":
        return dataclasses.replace(self, **changes)

    def summary(self) -> str:
        """One line: the model, the retention and the step."""
        gqa = f" ({self.num_q_heads} q heads)" if self.num_q_heads != self.kv_heads else ""
        parts = [
            f"{self.layers} layers, {self.kv_heads}x{self.head_dim} KV heads{gqa}",
            f"{self.rows} row(s)/request" if self.rows != 1 else "",
            f"source {self.source_len}" if self.source_len else "",
            f"sink {self.sink}, window {self.window}"
            + (" (includes step)" if self.window_includes_step else "")
            + (f", query_window {self.query_window}" if self.query_window is not None else "")
            + (", reverse order" if self.reverse_step_order else "")
            + (f"; memory {self.memory} in blocks of {self.memory_block}, top {self.top_k}" if self.memory else ""),
            f"span {self.span}, T {self.step_tokens}"
            + (f", last chunk T {self.final_tokens} span {self.final_span}" if self.final_tokens else ""),
            "relative bias" if self.score_bias == "relative" else "",
            f"{self.slot_dtype} slots" if self.slot_dtype != "none" else "",
            f"{self.requests} requests",
        ]
        return "; ".join(p for p in parts if p)


def _fail(field: str, value, allowed: str) -> None:
    raise WorkloadError(f"{field}: got {value!r}; {allowed}")


def _int_field(w: Workload, field: str, lo: int, allow_none: bool = False) -> None:
    v = getattr(w, field)
    if v is None and allow_none:
        return
    if not is_int(v) or v < lo:
        _fail(field, v, f"expected an integer >= {lo}" + (" or null" if allow_none else ""))


def _check_fields(w: Workload) -> None:
    if not isinstance(w.name, str) or not w.name:
        _fail("name", w.name, "expected a non-empty string")
    if not isinstance(w.description, str):
        _fail("description", w.description, "expected a string")
    for f in ("layers", "kv_heads", "head_dim", "rows", "window", "span", "requests", "steps"):
        _int_field(w, f, 1)
    for f in ("source_len", "sink", "final_span", "seed", "check_steps", "check_requests", "memory"):
        _int_field(w, f, 0)
    for f in ("memory_block", "top_k"):
        _int_field(w, f, 1)
    if w.memory and w.window_includes_step:
        _fail("window_includes_step", True, "a workload with a memory (memory > 0) counts its window before the "
              "step: give window_includes_step: false, or memory: 0")
    if w.memory:
        try:
            w.retention()
        except ValueError as e:
            raise WorkloadError(f"memory: {e}") from None
    _int_field(w, "sources", 1)
    for f in ("q_heads", "tokens", "final_tokens", "block_size"):
        _int_field(w, f, 1, allow_none=True)
    _int_field(w, "query_window", 0, allow_none=True)
    for f in ("window_includes_step", "reverse_step_order"):
        if not isinstance(getattr(w, f), bool):
            _fail(f, getattr(w, f), "expected true or false")
    if w.num_q_heads % w.kv_heads:
        _fail("q_heads", w.q_heads, f"expected a multiple of kv_heads={w.kv_heads}")
    if w.step_tokens < w.span:
        _fail("tokens", w.tokens, f"expected tokens >= span={w.span} (the step's T holds its span)")
    if w.final_tokens is not None and w.final_span > w.final_tokens:
        _fail("final_span", w.final_span, f"expected final_span <= final_tokens={w.final_tokens}")
    if w.final_tokens is None and w.final_span:
        _fail("final_span", w.final_span, "set final_tokens too (a final step needs its T)")
    if w.score_bias not in SCORE_BIAS:
        _fail("score_bias", w.score_bias, f"expected one of {', '.join(SCORE_BIAS)}")
    if w.compile not in COMPILE_MODES:
        _fail("compile", w.compile, f"expected one of {', '.join(COMPILE_MODES)}")
    if w.dtype not in DTYPES:
        _fail("dtype", w.dtype, f"expected one of {', '.join(DTYPES)}")
    if w.slot_dtype != "none" and w.slot_dtype not in SLOT_DTYPE_NAMES:
        _fail("slot_dtype", w.slot_dtype, f"expected one of none, {', '.join(SLOT_DTYPE_NAMES)}")
    if isinstance(w.arrival, bool) or not isinstance(w.arrival, (int, float)) or not 0 <= w.arrival <= 1:
        _fail("arrival", w.arrival, "expected a probability in [0, 1]")
    sl = w.stream_len
    if (
        not isinstance(sl, tuple)
        or len(sl) != 2
        or any(not is_int(x) for x in sl)
        or not 1 <= sl[0] <= sl[1]
    ):
        _fail("stream_len", list(sl) if isinstance(sl, tuple) else sl,
              "expected [low, high], integers with 1 <= low <= high (tokens a request writes)")
    # The cache's own rules (query_window vs window and so on), reported as workload errors.
    try:
        w.config()
    except ValueError as e:
        raise WorkloadError(f"the cache rejects this workload: {e}") from None


# ------------------------------------------------------------------- YAML

_FIELDS = {f.name: f for f in dataclasses.fields(Workload)}


def parse_workload(data, size: Optional[str] = "small", origin: str = "workload") -> Workload:
    """Build a `Workload` from a parsed YAML mapping.

    Top-level keys are `Workload` fields, plus an optional `sizes:` mapping
    of size name -> overrides of those fields. `size` picks one (it must
    exist when `sizes` is given; `None` takes the top level alone).
    Raises `WorkloadError` naming `origin`, the key and what is allowed.
    """
    if not isinstance(data, dict):
        raise WorkloadError(f"{origin}: expected a mapping of workload fields at the top level, "
                            f"got {type(data).__name__}")
    data = dict(data)
    sizes = data.pop("sizes", None)
    fields = dict(data)
    if sizes is not None:
        if not isinstance(sizes, dict) or not sizes:
            raise WorkloadError(f"{origin}: 'sizes' must map size names to field overrides, got {sizes!r}")
        if size is not None:
            if size not in sizes:
                raise WorkloadError(
                    f"{origin}: no size {size!r}; this file has: {', '.join(map(str, sizes))} (pick one with --size)"
                )
            over = sizes[size] or {}
            if not isinstance(over, dict):
                raise WorkloadError(f"{origin}: sizes.{size} must be a mapping of field overrides, got {over!r}")
            fields.update(over)
    elif size not in (None, "small"):
        raise WorkloadError(f"{origin}: has no 'sizes' section, so there is no size {size!r}")
    unknown = sorted(str(k) for k in fields if k not in _FIELDS or k.startswith("_"))
    if unknown:
        raise WorkloadError(
            f"{origin}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(_FIELDS))}, sizes"
        )
    missing = [f.name for f in _FIELDS.values()
               if f.default is dataclasses.MISSING and f.name not in fields]
    if missing:
        raise WorkloadError(f"{origin}: missing required key(s) {', '.join(missing)}")
    if "stream_len" in fields:
        sl = fields["stream_len"]
        fields["stream_len"] = tuple(sl) if isinstance(sl, list) else sl
    if "arrival" in fields and isinstance(fields["arrival"], int) and not isinstance(fields["arrival"], bool):
        fields["arrival"] = float(fields["arrival"])
    if fields.get("description") is None:
        fields["description"] = ""
    try:
        return Workload(**fields)
    except WorkloadError as e:
        raise WorkloadError(f"{origin}: {e}") from None


def load_workload(path: str, size: Optional[str] = "small") -> Workload:
    """Read a workload YAML file (see `parse_workload`); errors are `WorkloadError`."""
    import yaml

    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise WorkloadError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise WorkloadError(f"{path}: not valid YAML{where}: {problem}") from None
    return parse_workload(data, size, origin=path)


# The workload `flexkv run` uses with no config: a shortened streaming-llm
# (window 252 instead of 1020) so the rings wrap several times within a run of
# about two minutes on a 2-core CPU, compile included.
BUILTIN = Workload(
    name="builtin",
    description="chat decode with StreamingLLM retention, shortened to run in about two minutes on a 2-core CPU",
    layers=4,
    kv_heads=8,
    head_dim=64,
    q_heads=32,
    sink=4,
    window=252,
    span=1,
    requests=16,
    stream_len=(200, 1500),
    arrival=0.05,
    steps=2000,
    seed=0,
    compile="layer",
)
