"""The `flexkv` entry of vLLM's `additional_config`, and what the plugin refuses to serve.

`{"flexkv": {"sink": S, "window": W}}` is flexkv's `SinkWindow(S, W)` served with a per-query
window (`query_window=W`, contract section 2): the query at stream index `p` attends the sinks
`j < S` (up to itself) and the `W` entries before it, `p - W <= j <= p`. That is what a prompt fed
one token at a time attends, so vLLM's chunked prefill, its batching and a preempted request's
recompute all give the same result as plain decoding.
"""

from __future__ import annotations

from typing import Optional

from ...config import SinkWindow, is_int

__all__ = ["KEY", "ALLOWED", "retention_from", "refusals", "check_engine"]

#: the key of vLLM's `additional_config` the plugin reads
KEY = "flexkv"
#: what the entry may hold
ALLOWED = ("sink", "window", "positions")


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
    unknown = sorted(set(entry) - set(ALLOWED))
    if unknown:
        raise ValueError(f'additional_config["{KEY}"] has unknown keys {unknown}; allowed: {list(ALLOWED)}')
    missing = [k for k in ("sink", "window") if k not in entry]
    if missing:
        raise ValueError(
            f'additional_config["{KEY}"] needs {missing}: "sink" (tokens kept from the stream\'s start) and '
            f'"window" (tokens kept before each query), e.g. {{"sink": 4, "window": 1020}}'
        )
    positions = entry.get("positions", "stream")
    if positions != "stream":
        raise ValueError(
            f'additional_config["{KEY}"]["positions"] must be "stream", got {positions!r}: vLLM rotates keys by '
            f"their stream index before it stores them, so StreamingLLM's in-cache positions would need every "
            f"kept key re-rotated at every step; flexkv does not serve them inside vLLM"
        )
    for k in ("sink", "window"):
        if not is_int(entry[k]):
            raise ValueError(f'additional_config["{KEY}"]["{k}"] must be an int, got {entry[k]!r}')
    if entry["window"] < 1:
        raise ValueError(
            f'additional_config["{KEY}"]["window"] must be >= 1 (tokens kept before each query), got {entry["window"]}'
        )
    return SinkWindow(entry["sink"], entry["window"])


def refusals(vllm_config) -> list:
    """Why an engine configured with the `flexkv` entry cannot be served exactly (empty: it can)."""
    out = []
    cache = vllm_config.cache_config
    if getattr(cache, "enable_prefix_caching", False):
        out.append(
            "prefix caching is on: a cached prefix would have to bring back blocks of the gap between the sinks "
            "and the window that flexkv returned to the pool; start the engine with enable_prefix_caching=False "
            "(--no-enable-prefix-caching)"
        )
    if vllm_config.speculative_config is not None:
        out.append(
            "speculative decoding is configured: its drafts and rejected tokens need blocks and positions the "
            "retention manager does not account for; start the engine without speculative_config"
        )
    dtype = getattr(cache, "cache_dtype", "auto")
    if dtype not in ("auto", None):
        out.append(f"kv_cache_dtype={dtype!r}: flexkv's attention reads the cache in the model's dtype only; "
                   f"use kv_cache_dtype='auto'")
    par = vllm_config.parallel_config
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
    if why:
        raise ValueError(f"flexkv cannot serve {retention!r} exactly in this engine:\n- " + "\n- ".join(why))
    return retention
