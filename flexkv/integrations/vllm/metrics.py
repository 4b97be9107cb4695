"""flexkv's retention in an engine's Prometheus metrics, beside vLLM's own (`vllm serve`'s `/metrics`).

`FlexKVStatLogger` is loaded by vLLM through the `vllm.stat_logger_plugins` entry point into every
`AsyncLLM` (the OpenAI server's engine client, which owns `/metrics`); vLLM's offline `LLM` loads no
stat logger plugin. In an engine without a `flexkv` entry it records nothing and registers no metric.
With one, per engine (labels `model_name`, `engine`, as vLLM's):

- `flexkv:evicted_tokens_total`: over finished requests, the stream tokens that the request's next
  query would no longer read: `max(0, written - sink - window)`, `written` being the tokens its
  forwards wrote (prompt + generated - 1: the last sampled token is never written);
- `flexkv:returned_blocks_total`: over finished requests, the blocks of the stream that the retention
  had returned to vLLM's pool at its final length, the blocks wholly between the sink blocks and the
  window (`spec.freed_blocks`, the rule `SinkWindowManager` frees by);
- `flexkv:blocks_held`: the blocks the engine's running requests hold now (vLLM's KV-cache usage
  times its pool, less the null block): with the retention it stays at or below the block bound
  per request times the requests running;
- `flexkv:retention_info`: 1, labelled with the sink, window and block size served.

A request that ended before its first generated token is not counted (how much of its prompt was
written is not reported to the engine client). vLLM turns statistics on for an `AsyncLLM` when any
stat logger plugin is installed, so with flexkv installed, `--disable-log-stats` no longer turns
them off.
"""

from __future__ import annotations

from vllm.v1.metrics.loggers import StatLoggerBase

from .options import check_engine
from .spec import freed_blocks

__all__ = ["FlexKVStatLogger", "request_counts"]

#: name -> collector: a process registers each metric once (several engines, several engine clients)
_METRICS: dict = {}
LABELS = ("model_name", "engine")


def request_counts(retention, block_size: int, caching: bool, prompt_tokens: int, generated_tokens: int) -> tuple:
    """`(evicted tokens, returned blocks)` of a request that ended with `prompt_tokens` in and `generated_tokens`
    out under `retention`; `(0, 0)` when it generated nothing."""
    if generated_tokens < 1:
        return 0, 0
    written = prompt_tokens + generated_tokens - 1
    evicted = retention.window_start(written, 0) - retention.sink  # what the next query no longer reads
    first, stop = freed_blocks(retention, block_size, written, caching)
    return evicted, max(0, stop - first)


def _metric(kind: str, name: str, doc: str, labels=LABELS):
    if name not in _METRICS:
        import prometheus_client

        _METRICS[name] = getattr(prometheus_client, kind)(name, doc, labelnames=labels)
    return _METRICS[name]


class FlexKVStatLogger(StatLoggerBase):
    """One engine's flexkv metrics (vLLM makes one per engine: `FlexKVStatLogger(vllm_config, engine_index)`)."""

    def __init__(self, vllm_config, engine_index: int = 0):
        self.retention = check_engine(vllm_config)
        if self.retention is None:
            return
        cache = vllm_config.cache_config
        self.block_size = cache.block_size
        self.caching = bool(cache.enable_prefix_caching)
        self.config = vllm_config
        labels = (str(vllm_config.model_config.served_model_name), str(engine_index))
        self.evicted = _metric("Counter", "flexkv:evicted_tokens", "Stream tokens of finished requests that "
                               "their next query would not read (outside the sinks and the window)").labels(*labels)
        self.returned = _metric("Counter", "flexkv:returned_blocks", "Blocks of finished requests' streams that "
                                "the retention returned to the pool by their final length").labels(*labels)
        self.held = _metric("Gauge", "flexkv:blocks_held", "KV-cache blocks the running requests hold "
                            "now").labels(*labels)
        info = _metric("Gauge", "flexkv:retention_info", "The sink + window retention served (value 1)",
                       LABELS + ("sink", "window", "block_size"))
        info.labels(*labels, str(self.retention.sink), str(self.retention.window), str(self.block_size)).set(1)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if self.retention is None:
            return
        if iteration_stats is not None:
            for req in iteration_stats.finished_requests:
                evicted, returned = request_counts(self.retention, self.block_size, self.caching,
                                                   req.num_prompt_tokens, req.num_generation_tokens)
                self.evicted.inc(evicted)
                self.returned.inc(returned)
        if scheduler_stats is not None:
            engines = getattr(self.config.parallel_config, "data_parallel_size", 1) or 1  # the pool is summed over them
            pool = (self.config.cache_config.num_gpu_blocks or 0) // engines
            if pool > 1:
                self.held.set(round(scheduler_stats.kv_cache_usage * (pool - 1)))

    def log_engine_initialized(self):
        pass
