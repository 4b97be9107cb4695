"""The `flexkv` entry of vLLM's `additional_config`, and what the plugin refuses to serve.

`{"flexkv": {"sink": S, "window": W}}` is flexkv's `SinkWindow(S, W)` served with a per-query
window (`query_window=W`, contract section 2): the query at stream index `p` attends the sinks
`j < S` (up to itself) and the `W` entries before it, `p - W <= j <= p`. That is what a prompt fed
one token at a time attends, so vLLM's chunked prefill, its batching and a preempted request's
recompute all give the same result as plain decoding.

`positions` (optional) says which positions the model's rotary embedding turns keys and queries by:
`"cache"`, StreamingLLM's in-cache positions (the sinks keep theirs, every later entry moves down by
the number evicted), or `"stream"`, each token's index in its stream. Unset, it is `"cache"` for a
model whose rotary embedding flexkv serves in that mode (`SERVED_ROPE`) and `"stream"` otherwise.
Either way the model's rotary table must cover every stream index a request reaches
(`max_model_len`); the plugin lengthens the tables of the rope types in `SERVED_ROPE`, whose rows
are a plain function of the position, and refuses an engine that would rotate past any other table.
"""

from __future__ import annotations

from typing import Optional

from ...config import SinkWindow, is_int

__all__ = ["KEY", "ALLOWED", "POSITIONS", "SERVED_ROPE", "retention_from", "positions_from", "rope_of",
           "rope_table_len", "serving_positions", "refusals", "check_engine", "startup_line", "REQUEST_ALLOWED",
           "PROMPT_SINK", "request_retention", "RECALL_KEYS", "check_recall"]

#: the key of vLLM's `additional_config` the plugin reads
KEY = "flexkv"
#: what the entry may hold
ALLOWED = ("sink", "window", "positions")
#: the position modes the entry's `positions` takes
POSITIONS = ("cache", "stream")
#: `flexkv.Recall`'s fields beyond sink and window: named to refuse them with the reason (`check_recall`)
RECALL_KEYS = ("memory", "block", "top_k")
#: why the plugin does not serve a `Recall` memory
RECALL_REFUSED = (
    "flexkv's Recall (a memory of evicted blocks, the top-k read per step) is not served in vLLM: vLLM's "
    "KV-cache manager frees a request's blocks once they leave the window, and its attention backends read "
    "the window only, so the memory would be neither kept nor read (the answer would silently be sinks + "
    "window); serve Recall through flexkv.integrations.transformers.FlexKVCache or StreamSession, or give "
    "sink and window alone here"
)


def check_recall(entry: dict, where: str) -> None:
    """Refuse an entry that asks for a `Recall` memory, naming the keys and why."""
    asked = sorted(k for k in entry if k in RECALL_KEYS)
    if asked:
        raise ValueError(f"{where} asks for {asked}: {RECALL_REFUSED}")


#: rope types served in both modes: a row of their cos/sin table is a rotation by a fixed set of
#: frequencies, so rotations compose (`R(a) R(b) = R(a + b)`) and a longer table only adds rows
SERVED_ROPE = ("default", "linear", "llama3")


def retention_from(additional_config) -> Optional[SinkWindow]:
    """The `SinkWindow` that `additional_config["flexkv"]` asks for, or None when it has no entry.

    Raises `ValueError` naming a bad value: an entry that is not a dict, an unknown key, a missing
    or non-integer `sink` / `window`, or `positions` other than `"stream"`.
    """
    if not isinstance(additional_config, dict) or KEY not in additional_config:
        return None
    entry = additional_config[KEY]
    if not isinstance(entry, dict):
        raise ValueError(
            f'additional_config["{KEY}"] must be a dict such as {{"sink": 4, "window": 1020}}, got {entry!r}'
        )
    check_recall(entry, f'additional_config["{KEY}"]')
    unknown = sorted(set(entry) - set(ALLOWED))
    if unknown:
        raise ValueError(f'additional_config["{KEY}"] has unknown keys {unknown}; allowed: {list(ALLOWED)}')
    missing = [k for k in ("sink", "window") if k not in entry]
    if missing:
        raise ValueError(
            f'additional_config["{KEY}"] needs {missing}: "sink" (tokens kept from the stream\'s start) and '
            f'"window" (tokens kept before each query), e.g. {{"sink": 4, "window": 1020}}'
        )
    positions_from(additional_config)
    for k in ("sink", "window"):
        if not is_int(entry[k]):
            raise ValueError(f'additional_config["{KEY}"]["{k}"] must be an int, got {entry[k]!r}')
    if entry["window"] < 1:
        raise ValueError(
            f'additional_config["{KEY}"]["window"] must be >= 1 (tokens kept before each query), got {entry["window"]}'
        )
    return SinkWindow(entry["sink"], entry["window"])


def positions_from(additional_config) -> Optional[str]:
    """The entry's `positions` (`"cache"` or `"stream"`), or None when it does not say (the default applies)."""
    if not isinstance(additional_config, dict) or not isinstance(additional_config.get(KEY), dict):
        return None
    positions = additional_config[KEY].get("positions")
    if positions is not None and positions not in POSITIONS:
        raise ValueError(
            f'additional_config["{KEY}"]["positions"] must be one of {list(POSITIONS)}, got {positions!r}: "cache" '
            f"numbers kept entries as StreamingLLM does (quality holds past the model's trained context), "
            f'"stream" rotates by each token\'s index in its stream'
        )
    return positions


def rope_of(hf_config) -> Optional[dict]:
    """The model's rotary parameters (a dict with `"rope_type"`), or None when it has no rotary embedding."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = getattr(hf_config, "rope_scaling", None)
        if params is None and getattr(hf_config, "rope_theta", None) is None:
            return None
    params = dict(params or {})
    if "layer_types" in params or any(isinstance(v, dict) for v in params.values()):
        params = {"rope_type": "per-layer"}  # one rope per layer type (Gemma 3 and others)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def rope_table_len(hf_config) -> Optional[int]:
    """Stream indices the model's own rotary table covers (None: no rotary embedding, or unknown)."""
    rope = rope_of(hf_config)
    n = getattr(hf_config, "max_position_embeddings", None)
    if rope is None or n is None:
        return None
    if rope["rope_type"] == "linear":
        return int(n * rope.get("factor", 1))
    return n


def serving_positions(vllm_config) -> str:
    """The position mode an engine with the entry serves: the entry's, else the default (`"cache"` where
    `SERVED_ROPE` has the model's rope type, `"stream"` otherwise). Raises `ValueError` when `"cache"` is
    asked of a model it cannot be served for."""
    asked = positions_from(getattr(vllm_config, "additional_config", None))
    rope = rope_of(vllm_config.model_config.hf_text_config)
    served = rope is not None and rope["rope_type"] in SERVED_ROPE
    if asked == "cache" and not served:
        what = "no rotary embedding" if rope is None else f"rope_type {rope['rope_type']!r}"
        raise ValueError(
            f'additional_config["{KEY}"]["positions"] is "cache", but the model has {what}: flexkv serves '
            f'in-cache positions for rope types {list(SERVED_ROPE)}; use "positions": "stream"'
        )
    return asked or ("cache" if served else "stream")


def startup_line(retention: SinkWindow, positions: str, max_model_len: int, prefix_caching: bool = False,
                 own_requests: str = "") -> str:
    """What the plugin logs once per engine: how many keys a query reads, in flexkv's terms and vLLM's, which
    kernel a decode step past eviction runs on, and whether a request may keep less (`own_requests`: why
    not, from `requests.own_retention_unserved`; "" where it may)."""
    s, w = retention.sink, retention.window
    kernel = ("prefix caching on: a prompt resumes from a cached prefix whose sink blocks and window tail are "
              "cached; decode steps past eviction run vLLM's sliding-window kernel, the sinks copied into "
              "scratch blocks each request holds") if prefix_caching else \
        "decode steps past eviction run vLLM's sliding-window kernel"
    return (f"flexkv: sink {s} + window {w}: each query reads at most {s + w + 1} keys: its stream's first {s} "
            f"tokens, the {w} tokens before it, and itself (in vLLM's terms, sliding_window={w + 1} plus {s} "
            f"sinks); positions {positions!r}; streams up to max_model_len={max_model_len} tokens; {kernel}; "
            + (f"a request may keep less (SamplingParams extra_args {{'{KEY}': {{'sink': ..., 'window': ...}}}})"
               if not own_requests else f"a request's own retention is refused (served {own_requests})"))


def refusals(vllm_config) -> list:
    """Why an engine configured with the `flexkv` entry cannot be served exactly (empty: it can)."""
    out = []
    cache = vllm_config.cache_config
    if vllm_config.speculative_config is not None:
        out.append(
            "speculative decoding is configured: its drafts and rejected tokens need blocks and positions the "
            "retention manager does not account for; start the engine without speculative_config"
        )
    dtype = getattr(cache, "cache_dtype", "auto")
    if dtype not in ("auto", None):
        out.append(f"kv_cache_dtype={dtype!r}: flexkv's attention reads the cache in the model's dtype only; "
                   f"use kv_cache_dtype='auto'")
    model = getattr(vllm_config, "model_config", None)
    if model is not None:
        rope = rope_of(model.hf_text_config)
        table = rope_table_len(model.hf_text_config)
        if table is not None and model.max_model_len > table and rope["rope_type"] not in SERVED_ROPE:
            out.append(f"max_model_len={model.max_model_len} is past the model's rotary table ({table} positions, "
                       f"rope_type {rope['rope_type']!r}), which flexkv lengthens only for rope types "
                       f"{list(SERVED_ROPE)}: streams would be rotated by positions the model has no table for; "
                       f"use max_model_len <= {table}")
        elif rope is None and getattr(model.hf_text_config, "max_position_embeddings", None) is not None \
                and model.max_model_len > model.hf_text_config.max_position_embeddings:
            out.append(f"max_model_len={model.max_model_len} is past the model's "
                       f"{model.hf_text_config.max_position_embeddings} learned positions; use max_model_len <= "
                       f"{model.hf_text_config.max_position_embeddings}")
    par = vllm_config.parallel_config
    if getattr(par, "pipeline_parallel_size", 1) not in (1, None):
        out.append(f"pipeline_parallel_size={par.pipeline_parallel_size}: flexkv has not run under pipeline "
                   f"parallelism (vLLM's CPU build 0.32 stops with it even without flexkv), so it is not "
                   f"served; use 1 (tensor parallelism is served)")
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        out.append("a KV connector is configured (kv_transfer_config): it would move blocks by a block table "
                   "whose evicted middle is vLLM's null block, and the receiving side would not know the "
                   "retention; start the engine without kv_transfer_config")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(par, name, 1) not in (1, None):
            out.append(f"{name}={getattr(par, name)}: context parallelism splits a stream's tokens across ranks, "
                       f"which the retention manager does not handle; use 1")
    return out


def check_engine(vllm_config) -> Optional[SinkWindow]:
    """The retention to serve, or None when the engine has no `flexkv` entry.

    Raises `ValueError` listing every reason the configuration cannot be served exactly.
    """
    retention = retention_from(getattr(vllm_config, "additional_config", None))
    if retention is None:
        return None
    why = refusals(vllm_config)
    if getattr(vllm_config, "model_config", None) is not None:
        try:
            serving_positions(vllm_config)
        except ValueError as e:
            why.append(str(e))
    if why:
        raise ValueError(f"flexkv cannot serve {retention!r} exactly in this engine:\n- " + "\n- ".join(why))
    return retention


#: what a request's own retention may say: `extra_args={"flexkv": {...}}`, or over HTTP the flat `vllm_xargs`
#: keys `flexkv_sink` / `flexkv_window`
REQUEST_ALLOWED = ("sink", "window")
#: a request's `sink` that keeps its whole prompt (prefix + window)
PROMPT_SINK = "prompt"


def _request_entry(extra_args) -> Optional[dict]:
    """The retention a request's `extra_args` names, as a dict (None: it names none). Raises `ValueError` for a
    flexkv key that is not one of `REQUEST_ALLOWED`, or one given both nested and flat."""
    if not isinstance(extra_args, dict):
        return None
    ours = sorted(str(k) for k in extra_args if str(k).lower().startswith(KEY))
    if not ours:
        return None
    flat = {k[len(KEY) + 1:]: extra_args[k] for k in ours if k.startswith(KEY + "_")}
    nested = extra_args.get(KEY)
    allowed = [KEY] + [f"{KEY}_{k}" for k in REQUEST_ALLOWED]
    check_recall(flat, f"extra_args {sorted(KEY + '_' + k for k in flat if k in RECALL_KEYS)}")
    if isinstance(extra_args.get(KEY), dict):
        check_recall(extra_args[KEY], f'extra_args["{KEY}"]')
    unknown = [k for k in ours if k not in allowed]
    if unknown:
        raise ValueError(f"extra_args {unknown}: not a key flexkv reads; a request's own retention is extra_args="
                         f'{{"{KEY}": {{"sink": S, "window": W}}}}, or over HTTP vllm_xargs {allowed[1:]}')
    if nested is not None and flat:
        raise ValueError(f'extra_args gives both "{KEY}" and {sorted(KEY + "_" + k for k in flat)}; give one')
    if nested is None:
        return flat
    if not isinstance(nested, dict) or set(nested) - set(REQUEST_ALLOWED):
        raise ValueError(f'extra_args["{KEY}"] must be a dict with keys among {list(REQUEST_ALLOWED)}, such as '
                         f'{{"sink": 4, "window": 252}}, got {nested!r}')
    return dict(nested)


def request_retention(extra_args, engine: Optional[SinkWindow], prompt_len: Optional[int] = None
                      ) -> Optional[SinkWindow]:
    """The retention a request asks for in its `SamplingParams.extra_args`, or None when it names none (the
    engine's applies).

    A request may narrow the engine's retention, not widen it: `sink` in `[0, engine sink]` (or `"prompt"`:
    its whole prompt, `prompt_len` tokens, kept as sinks), `window` in `[1, engine window]`; a key it leaves
    out is the engine's. The engine's retention is the maximum because it sizes everything vLLM plans by:
    the block bound per request, the pool, admission. Raises `ValueError` naming the value, what is allowed
    and the fix; an engine without a `flexkv` entry (`engine` None) refuses any flexkv key (it serves no
    retention of flexkv's for the request).
    """
    entry = _request_entry(extra_args)
    if entry is None:
        return None
    if engine is None:
        raise ValueError(f"extra_args {entry}: this engine serves no flexkv retention (its additional_config has no "
                         f'"{KEY}" entry), so it cannot narrow one; start it with additional_config={{"{KEY}": '
                         f'{{"sink": S, "window": W}}}}, the most any request may keep, or drop the key')
    sink, window = entry.get("sink", engine.sink), entry.get("window", engine.window)
    fix = (f"the engine serves at most sink {engine.sink} + window {engine.window} (its additional_config"
           f'["{KEY}"], which sizes its block pool and admission); start it with a wider one to serve this request')
    if sink == PROMPT_SINK:
        if prompt_len is None:
            return None  # checked again where the prompt's length is known
        if prompt_len > engine.sink:
            raise ValueError(f'extra_args sink "{PROMPT_SINK}" keeps the whole prompt, {prompt_len} tokens, as sinks, '
                             f"more than the engine's sink {engine.sink}; {fix}")
        sink = prompt_len
    if not is_int(sink) or not 0 <= sink <= engine.sink:
        raise ValueError(f'extra_args sink must be an int in [0, {engine.sink}] or "{PROMPT_SINK}", got {sink!r}; '
                         f"{fix}")
    if not is_int(window) or not 1 <= window <= engine.window:
        raise ValueError(f"extra_args window must be an int in [1, {engine.window}] (tokens kept before each query), "
                         f"got {window!r}; {fix}")
    return SinkWindow(sink, window)
