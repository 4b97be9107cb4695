"""The KV-cache spec and block manager of a sink + window layer.

`SinkWindowSpec` is vLLM's `SlidingWindowSpec` with `sink` added: vLLM's `sliding_window` counts
the keys a decode query attends with itself included, so flexkv's `window` (entries before the
query) is `sliding_window - 1`. The spec gives vLLM the per-request block bound that both its
start-up pool sizing and its admission use; `SinkWindowManager` frees, as a request advances,
every block that lies wholly between the sink blocks and the window, and hands back nothing
else until the request ends.

With prefix caching on, a request also holds `SCRATCH_BLOCKS` (2) past the block its next token
lands in: a decode step past eviction copies the first block its window touches there and writes
the sinks below the window in the copy (`backend.decode_plan`), so no block the prefix cache may
hand to another request is written. They are the request's own next blocks, not yet full and so
never cached; the stream's own tokens overwrite them when it reaches them.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.config import get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_utils import resolve_block_hashes
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import SlidingWindowSpec

from ...config import SinkWindow

__all__ = ["SinkWindowSpec", "SinkWindowManager", "block_bound", "freed_blocks", "pool_line", "SCRATCH_BLOCKS"]

#: blocks a request holds past its last token with prefix caching: where a decode step's sink copies go (the
#: first takes a copy of the block holding the window's first entry, the second the sink slots that reach
#: into the block before it)
SCRATCH_BLOCKS = 2

logger = init_logger("vllm.flexkv")  # under vLLM's logger, whose handler prints INFO
_announced = set()


def pool_line(retention: SinkWindow, block_size: int, bound: int, pool_blocks: int, max_num_seqs=None) -> str:
    """What an operator needs to size an engine: the block bound per request (`bound`, as vLLM admits with it),
    and the whole streams the pool holds at that bound (against `max_num_seqs`, where known: past it vLLM
    would have to preempt)."""
    streams = pool_blocks // bound
    line = (f"flexkv: a request under {retention!r} holds at most {bound} blocks of {block_size} tokens, "
            f"whatever its length; the pool's {pool_blocks} blocks hold {streams} such streams at once")
    if max_num_seqs is not None:
        line += (f" (max_num_seqs={max_num_seqs}: no preemption for lack of blocks)" if streams >= max_num_seqs
                 else f" (max_num_seqs={max_num_seqs} can run more: set it to {streams} or less to keep preemption "
                      f"away)")
    return line


def block_bound(retention: SinkWindow, block_size: int, tokens_in_flight: int) -> int:
    """The most blocks one request holds under `retention`, whatever its length:
    `ceil(sink / B) + ceil((sink + window - 1 + tokens_in_flight) / B) + 1`.

    A step writing `T` tokens from stream index `n` reads the sinks (the first `ceil(sink / B)`
    blocks) and `n - window .. n + T - 1`, `window + T` entries; the `sink` entries just below the
    window are kept too (a decode step copies the sinks there for vLLM's sliding-window kernel,
    `backend.FlexKVCPUImpl`). Those `sink + window + T` entries touch at most
    `ceil((sink + window + T - 1) / B) + 1` blocks when they do not start at a block's edge. With
    prefix caching the request holds `SCRATCH_BLOCKS` more past its last token (`SinkWindowManager`).
    """
    sink = retention.sink
    return cdiv(sink, block_size) + cdiv(sink + retention.window - 1 + tokens_in_flight, block_size) + 1


def freed_blocks(retention: SinkWindow, block_size: int, processed: int, caching: bool) -> tuple:
    """The blocks `[first, stop)` of a request's table that `SinkWindowManager` has returned once the query at
    stream index `processed` is next (empty when `stop <= first`): every block wholly after the sink blocks
    and before what that query and every later one read. Without prefix caching the `sink` entries just
    below the window are kept too (a decode step copies the sinks there, `backend.FlexKVCPUImpl`)."""
    below = 0 if caching else retention.sink
    lo = max(retention.sink, retention.window_start(processed, 0) - below)
    return cdiv(retention.sink, block_size), lo // block_size


@dataclass(frozen=True, kw_only=True)
class SinkWindowSpec(SlidingWindowSpec):
    """A decoder layer under `SinkWindow(sink, sliding_window - 1)` with a per-query window."""

    sink: int = 0
    #: blocks a request holds past its last token for a decode step's sink copies (prefix caching on), else 0
    scratch: int = 0

    @property
    def retention(self) -> SinkWindow:
        return SinkWindow(self.sink, self.sliding_window - 1)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        return min(block_bound(self.retention, self.block_size, max_in_flight_tokens),
                   cdiv(max_model_len, self.block_size)) + self.scratch

    def max_num_blocks_per_req(self, vllm_config, max_len: int) -> int:
        # the worker's block table row: the stream's blocks and the scratch past them
        return cdiv(max_len, self.block_size) + self.scratch

    def is_uniform_with_collection(self, kv_cache_specs) -> bool:
        return all(isinstance(s, SinkWindowSpec) and s.sliding_window == self.sliding_window and s.sink == self.sink
                   and s.scratch == self.scratch for s in kv_cache_specs.values())


class SinkWindowManager(SlidingWindowManager):
    """Keeps a request's sink blocks and the blocks its next query's window (and the `sink` slots below it)
    touches; frees the rest.

    With prefix caching (`scratch` in the spec), every allocation reaches `scratch` blocks past the
    request's tokens (the decode step's sink copies go there, `backend.decode_plan`).

    Freed blocks become vLLM's null block in the request's block table (as the sliding-window
    manager does), so block indices keep meaning stream positions. With prefix caching on, every full
    block is cached as vLLM caches it, and a prompt hits a cached prefix of `n` blocks when the
    blocks its next query reads are cached: the sink blocks and the window's contiguous tail just
    before the hit point (`find_longest_cache_hit`); the gap between them comes back as null blocks.
    """

    def __init__(self, kv_cache_spec: SinkWindowSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.retention = kv_cache_spec.retention
        #: tokens allocated past what vLLM asks for: the scratch blocks
        self.slack = kv_cache_spec.scratch * self.block_size
        # vLLM hands the manager the bound it admits with (the spec's, at its own tokens in flight)
        bound = getattr(self, "max_admission_blocks_per_request", None)
        if bound:
            cfg = get_current_vllm_config_or_none()
            seqs = getattr(getattr(cfg, "scheduler_config", None), "max_num_seqs", None)
            line = pool_line(self.retention, self.block_size, bound, self.block_pool.num_gpu_blocks - 1, seqs)
            if line not in _announced:
                _announced.add(line)
                logger.info(line)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args, **kwargs) -> int:
        return super().get_num_blocks_to_allocate(request_id, num_tokens + self.slack, *args, **kwargs)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, *args, **kwargs):
        return super().allocate_new_blocks(request_id, num_tokens + self.slack, *args, **kwargs)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # vLLM reads this as "the first N tokens are gone"; here the sinks stay, so no prefix is skipped.
        return 0

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens=None) -> None:
        # The next query (stream index `processed_computed_tokens`) and every later one read nothing
        # below its window's start except the sinks; without prefix caching the `sink` slots just below
        # the window take the sinks' copies of a decode step (`backend.FlexKVCPUImpl`). Free the blocks
        # wholly between those and the sinks.
        first, stop = freed_blocks(self.retention, self.block_size, processed_computed_tokens, self.enable_caching)
        self._remove_blocks_in_range(request_id, first, stop)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                               drop_eagle_block, alignment_tokens, dcp_world_size=1, pcp_world_size=1):
        """The longest cached prefix the request can resume from: `n` blocks (`n * B <= max_length`, a
        multiple of `alignment_tokens`) such that the query at stream index `n * B` finds everything it
        reads cached: the sink blocks `[0, ceil(sink / B))` and the window's blocks
        `[(n * B - window) // B, n)`. Returns, per group, the `n` blocks with the gap between the two as
        null blocks, and the hit length `n * B` (0 blocks where there is none)."""
        if drop_eagle_block or dcp_world_size != 1 or pcp_world_size != 1:
            raise ValueError("flexkv's retention manager serves no EAGLE drafts and no context parallelism")
        pol, bs = kv_cache_spec.retention, kv_cache_spec.block_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, bs, alignment_tokens=alignment_tokens)
        limit, found = max_length // bs, {}

        def cached(i):  # the cached block of each group for block `i` of the prompt, or None
            if i >= limit:
                return None
            if i not in found:
                found[i] = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
            return found[i]

        def aligned(n):
            return not alignment_tokens or (n * bs) % alignment_tokens == 0

        def first_window_block(n):
            return max(0, n * bs - pol.window) // bs

        def longest_aligned(n):  # the most blocks, at most `n`, a hit may have
            return next((m for m in range(n, 0, -1) if aligned(m)), 0)

        sink_blocks = cdiv(pol.sink, bs)
        hit, n = 0, None  # `n`: the longest hit the cached run the scan is in could give
        for i in range(limit - 1, -1, -1):
            if cached(i) is None:
                n = None
                continue
            n = longest_aligned(i + 1) if n is None else n
            if n <= i or first_window_block(n) < i:
                continue  # the run does not reach back to the window's start yet
            if i == 0 or all(cached(j) is not None for j in range(min(sink_blocks, n))):
                hit = n
                break
            # the sinks are not cached: only a run from block 0 (a plain prefix) can be a hit
            run = 0
            while cached(run) is not None:
                run += 1
            hit = longest_aligned(run)
            break
        null = block_pool.null_block
        keep = set(range(min(sink_blocks, hit))) | set(range(first_window_block(hit), hit))
        blocks = tuple([cached(j)[g] if j in keep else null for j in range(hit)] for g in range(len(kv_cache_group_ids)))
        return blocks, hit * bs

    @classmethod
    def reachable_block_mask(cls, *args, **kwargs):
        # every full block may serve a hit: the sink blocks for every later hit point, the rest as a window's tail
        return None

    def held_blocks(self, request_id: str) -> int:
        """Blocks `request_id` holds now (its table's entries that are not the null block)."""
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if not b.is_null)
