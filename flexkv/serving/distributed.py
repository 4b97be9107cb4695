"""Tensor-parallel flexkv: each rank caches only its share of the KV heads.

In tensor-parallel attention every rank computes the queries, keys and
values of a contiguous block of heads (a column-parallel QKV projection),
attends over them, and the ranks combine their partial outputs after the
output projection. A rank's cache is therefore an ordinary
`BoundedKVManager` whose config has `num_heads // world_size` heads, built
with a store factory that keeps the rank's heads (`BoundedKVManager(config,
device, store=ShardStores(HeadShard(...)))`): `ShardedKVManager` is exactly
that (with the rank read from a process group), plus an optional
consistency check.

Nothing in the host planner looks at heads, so the slot table and every plan
are the same on every rank as long as every rank makes the same calls in the
same order. The cache itself therefore never communicates: the only
per-step traffic is the model's own (the all-reduce after the output
projection).

What the caller must keep identical on every rank of the group:

- the sequence of `add_source` / `remove_source` calls (sources take the
  lowest free index);
- the sequence of `admit` / `reset_request` / `remove_request` calls and the
  steps they get (new requests take the lowest free slot, in segment order);
- the steps handed to `plan` and `commit` (the same segments and positions).

A scheduler that runs on one rank and broadcasts its decisions, or a
deterministic scheduler replicated on every rank, satisfies this. A rank that
drifts (say, it removes a request the others keep) gets different slots and
silently reads another request's keys. `ShardedKVManager.check_in_sync` (or
`check_plans=True`, which runs it in every `plan`) detects that with one
all-gather of four integers per rank; it is a debugging aid, not meant for
every step of a production run.

Head ownership: rank `r` of `world_size` owns KV heads
`[r * H / world_size, (r + 1) * H / world_size)` and, with grouped-query
attention (`Hq = g * H` query heads), query heads
`[r * Hq / world_size, (r + 1) * Hq / world_size)`: exactly the query heads
that read its KV heads, so a GQA group is never split.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, Hashable, Optional

import torch

from ..cache.groups import GroupedPlan
from ..cache.host.planner import BoundedPlan
from ..cache.manager import BoundedKVManager
from ..cache.storage.store import LayerStore
from ..config import BoundedKVConfig, check_config, is_int

__all__ = ["HeadShard", "ShardedKVManager", "ShardStore", "ShardStores", "resolve_rank", "all_gather_heads",
           "plan_digest"]



def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _dist():
    """`torch.distributed`, or a clear error when this torch build lacks it."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed; tensor-parallel flexkv needs it")
    return dist


def resolve_rank(process_group: Any = None, rank: Optional[int] = None, world_size: Optional[int] = None):
    """This process's `(rank, world_size)` in the tensor-parallel group.

    With `process_group` they are read from the group (`torch.distributed`
    must be initialised and this process a member); `rank`/`world_size`, if
    also given, must agree with it. Without a group, `world_size` defaults to
    1 and `rank` to 0; a `rank` without a `world_size` is an error.
    """
    for name, val in (("rank", rank), ("world_size", world_size)):
        if val is not None and not is_int(val):
            raise ValueError(f"{name} must be an int or None, got {val!r} ({type(val).__name__})")
    if process_group is not None:
        dist = _dist()
        if not dist.is_initialized():
            raise ValueError(
                "process_group was given but torch.distributed is not initialised; call "
                "torch.distributed.init_process_group() first (torchrun sets up the environment for it)"
            )
        group_rank = dist.get_rank(process_group)
        if group_rank < 0:
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of process_group; "
                f"build the cache only on the ranks of its tensor-parallel group"
            )
        group_size = dist.get_world_size(process_group)
        if rank is not None and rank != group_rank:
            raise ValueError(f"rank={rank} disagrees with process_group, where this process is rank {group_rank}")
        if world_size is not None and world_size != group_size:
            raise ValueError(f"world_size={world_size} disagrees with process_group, which has {group_size} ranks")
        return group_rank, group_size
    if rank is not None and world_size is None:
        raise ValueError(f"rank={rank} was given without world_size; give both, or a process_group")
    world_size = 1 if world_size is None else world_size
    rank = 0 if rank is None else rank
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    return rank, world_size


@dataclass(frozen=True)
class HeadShard:
    """Which heads rank `rank` of `world_size` owns, for a model with `num_heads` KV heads.

    `num_query_heads` (optional) is the model's query head count; giving it
    checks that the split keeps every GQA group (the `num_query_heads //
    num_heads` query heads reading one KV head) on one rank.
    """

    num_heads: int
    rank: int
    world_size: int
    num_query_heads: Optional[int] = None

    def __post_init__(self):
        for name in ("num_heads", "world_size"):
            val = getattr(self, name)
            if not is_int(val) or val < 1:
                raise ValueError(f"{name} must be an int >= 1, got {val!r}")
        if not is_int(self.rank) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, world_size={self.world_size}), got {self.rank!r}")
        H, W, Hq = self.num_heads, self.world_size, self.num_query_heads
        if Hq is not None:
            if not is_int(Hq) or Hq < 1 or Hq % H:
                raise ValueError(
                    f"num_query_heads must be a positive multiple of num_heads={H} (grouped-query attention), "
                    f"got {Hq!r}"
                )
            if H % W and Hq % W == 0:
                raise ValueError(
                    f"world_size={W} would split a GQA group across ranks: the {Hq} query heads read {H} KV heads "
                    f"in groups of {Hq // H}, and each rank must own whole KV heads with their groups; "
                    f"use a world size that divides {H} ({_divisors(H)})"
                )
        if H % W:
            raise ValueError(
                f"num_heads={H} KV heads cannot be split evenly over world_size={W} ranks; "
                f"use a world size that divides {H} ({_divisors(H)})"
            )

    @property
    def local_heads(self) -> int:
        """KV heads this rank holds: `num_heads // world_size`."""
        return self.num_heads // self.world_size

    @property
    def kv_slice(self) -> slice:
        """This rank's KV heads within the model's `num_heads`."""
        start = self.rank * self.local_heads
        return slice(start, start + self.local_heads)

    def query_slice(self, num_query_heads: Optional[int] = None) -> slice:
        """This rank's query heads within the model's `num_query_heads` (the GQA groups of its KV heads)."""
        Hq = self.num_query_heads if num_query_heads is None else num_query_heads
        if not is_int(Hq) or Hq < 1 or Hq % self.num_heads:
            raise ValueError(
                f"num_query_heads must be a positive multiple of num_heads={self.num_heads}, got {Hq!r}"
            )
        local = Hq // self.world_size
        return slice(self.rank * local, (self.rank + 1) * local)

    def kv(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's KV heads of a full-head tensor (a view along `dim`, which must hold `num_heads`)."""
        if t.shape[dim] != self.num_heads:
            raise ValueError(
                f"expected the full {self.num_heads} KV heads along dim {dim}, got shape {tuple(t.shape)}"
            )
        s = self.kv_slice
        return t.narrow(dim, s.start, s.stop - s.start)

    def query(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's query heads of a full-head query tensor (a view along `dim`)."""
        s = self.query_slice(t.shape[dim])
        return t.narrow(dim, s.start, s.stop - s.start)


def plan_digest(plan) -> str:
    """A short digest of a plan's host tables (a `BoundedPlan`, or a `GroupedPlan`'s every group plan):
    equal plans give equal digests in every process.

    BLAKE2b over the packed tables (Python's own `hash` of bytes is salted per
    process); a few microseconds for a 32-request plan.
    """
    h = hashlib.blake2b(digest_size=8)
    for p in (plan.plans if isinstance(plan, GroupedPlan) else (plan,)):
        h.update(p.host)
        h.update(struct.pack("<3q", p.rows, p.tokens, p.width))
    return h.hexdigest()


_MASK = (1 << 64) - 1


def _signed64(hex_digest: str) -> int:
    """A 16-hex-digit digest as a signed 64-bit int (what an int64 tensor holds)."""
    v = int(hex_digest, 16)
    return v - (1 << 64) if v >= 1 << 63 else v


def _stable_id(rid: Hashable) -> str:
    """A process-independent rendering of a request id (types whose repr may hold an address are named only)."""
    if rid is None or isinstance(rid, (str, int, float, bytes, tuple)):
        return repr(rid)
    return type(rid).__qualname__


class ShardStore(LayerStore):
    """A rank's `flexkv.cache.storage.store.LayerStore`: this rank's heads (`shard`), and of a source given with every
    head, this rank's slice (`source_tensors`)."""

    def __init__(self, config: BoundedKVConfig, device, layout, shard: HeadShard):
        super().__init__(config, device, layout)
        self.shard = shard

    def source_tensors(self, what: str, keys, values):
        """This rank's heads of a source given with every head or with this rank's (then checked)."""
        full, local = self.shard.num_heads, self.shard.local_heads
        picked = []
        for name, t in (("keys", keys), ("values", values)):
            if what == "add_source" and isinstance(t, torch.Tensor) and t.dim() == 5:
                if t.shape[2] == full:
                    t = self.shard.kv(t, dim=2)
                elif t.shape[2] != local:
                    s = self.shard.kv_slice
                    raise ValueError(
                        f"add_source: {name} has {t.shape[2]} heads (shape {tuple(t.shape)}); expected the model's "
                        f"{full} KV heads (rank {self.shard.rank} keeps heads {s.start}..{s.stop - 1}) or this "
                        f"rank's {local} already-sharded heads"
                    )
            picked.append(t)
        return super().source_tensors(what, *picked)


class ShardStores:
    """The store factory of a tensor-parallel rank: `BoundedKVManager(config, device, store=ShardStores(shard))`
    is rank `shard.rank`'s cache, each layer group keeping this rank's share of its KV heads.

    A store factory that keeps part of each group's heads tells the cache so (`group_config`: the group's
    config with this rank's heads, what the group is built with and `attend` checks), builds each group's
    store (`ShardStore`, which also slices sources given with every head), and checks that `attend` gets
    this rank's heads (`check_heads`). `shard` splits the model's own heads; a layer group with another
    head count is split alike (its `HeadShard` from `group_shard`)."""

    def __init__(self, shard: HeadShard):
        self.shard = shard

    def group_shard(self, num_heads: int) -> HeadShard:
        """The split of a layer group with `num_heads` KV heads (the model's query heads checked only for
        the model's own head count)."""
        s = self.shard
        return HeadShard(num_heads, s.rank, s.world_size, s.num_query_heads if num_heads == s.num_heads else None)

    def group_config(self, config: BoundedKVConfig) -> BoundedKVConfig:
        """A group's config (every head) as this rank keeps it."""
        return config.replace(num_heads=self.group_shard(config.num_heads).local_heads)

    def __call__(self, config: BoundedKVConfig, device, layout) -> "ShardStore":
        """The store of a group whose config `group_config` made (this rank's heads)."""
        return ShardStore(config, device, layout, self.group_shard(config.num_heads * self.shard.world_size))

    def check_heads(self, group, q, k, v) -> None:
        """Refuse an `attend` call given every head where this rank takes its share."""
        shard = group.store.shard
        full, local = shard.num_heads, shard.local_heads
        for name, t in (("k", k), ("v", v)):
            if full != local and isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[1] == full:
                raise ValueError(
                    f"attend: {name} has all {full} KV heads; rank {shard.rank} of {shard.world_size} takes only "
                    f"its {local} (slice them with manager.shard.kv({name}), or project only this rank's heads)"
                )
        Hq = shard.num_query_heads
        if Hq is not None and isinstance(q, torch.Tensor) and q.dim() == 4:
            want = Hq // shard.world_size
            if q.shape[1] != want:
                raise ValueError(
                    f"attend: q has {q.shape[1]} heads; rank {shard.rank} of {shard.world_size} takes its "
                    f"{want} of the model's {Hq} query heads (slice them with manager.shard.query(q))"
                )


class ShardedKVManager(BoundedKVManager):
    """This rank's share of a tensor-parallel bounded KV cache: a `BoundedKVManager` whose every layer
    group holds this rank's heads.

    Args:
        config: the model's config, with every KV head (`config.num_heads`).
            The cache holds `num_heads // world_size` of them; `self.config`
            is that per-rank config (what `attend` checks) and
            `self.full_config` the one given here.
        device: where this rank's KV tensors live (its accelerator).
        groups: as for `BoundedKVManager` (a group's own `num_heads` is the model's count for
            those layers; the rank keeps its share of each).
        process_group: the tensor-parallel group; rank and size are read from
            it. Or give `rank` and `world_size` directly (then `check_in_sync`
            uses the default group).
        num_query_heads: the model's query head count, optional; when given,
            the split is checked to keep GQA groups whole and `attend` checks
            that it gets this rank's `num_query_heads // world_size` heads.
        block_size: FlexAttention's KV block size (None: flexkv picks one for the config and device).
        check_plans: run `check_in_sync` in every `plan` (debugging: one
            small collective per step).

    `attend` takes this rank's heads: `q [N, Hq / world_size, T, D]`, `k
    [N, num_heads / world_size, T, D]`, `v [N, num_heads / world_size, T, Dv]`
    (`Dv = value_head_dim`), and returns `[N, Hq / world_size, T, Dv]`.
    `memory_bytes` and `slot_bytes` are this rank's share.
    """

    def __init__(
        self,
        config: BoundedKVConfig,
        device="cpu",
        *,
        groups=None,
        process_group: Any = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        num_query_heads: Optional[int] = None,
        block_size: Optional[int] = None,
        check_plans: bool = False,
    ):
        check_config(config)
        if not isinstance(check_plans, bool):
            raise ValueError(f"check_plans must be a bool, got {check_plans!r}")
        rank, world_size = resolve_rank(process_group, rank, world_size)
        stores = ShardStores(HeadShard(config.num_heads, rank, world_size, num_query_heads))
        super().__init__(config, device, groups=groups, block_size=block_size, store=stores)
        #: Which of the model's heads this rank keeps (`HeadShard`).
        self.shard = stores.shard
        self.full_config = config
        self.process_group = process_group
        self.check_plans = check_plans

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def world_size(self) -> int:
        return self.shard.world_size

    # ---------------------------------------------------------------- sources

    def add_source(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Register a source from the full-head tensors (this rank keeps its slice) or this rank's slice.

        `keys`: `[num_layers, rows_per_request, H, L, head_dim]`, `values` the same with
        `value_head_dim`, `H` the model's `num_heads` or this rank's `num_heads // world_size`.
        """
        return super().add_source(keys, values)

    # -------------------------------------------------------------- attention

    def _plan_step(self, step, slots, private, eager_only):
        """Plan `step` as `BoundedKVManager` does (`plan`, `plan_eager`); with `check_plans`, also
        `check_in_sync(plan)`."""
        plan = super()._plan_step(step, slots, private, eager_only)
        if self.check_plans:
            self.check_in_sync(plan)
        return plan

    # ------------------------------------------------------------ consistency

    def state_digest(self) -> str:
        """A digest of the host state every rank must share: requests, slots, written counts, sources."""
        with self._lock:
            requests, free, sources, private = self.slots.snapshot()
            state = ([(_stable_id(rid), *rest) for rid, *rest in requests], list(free), list(sources),
                     [(_stable_id(rid), place) for rid, place in private])
        return hashlib.blake2b(repr(state).encode(), digest_size=8).hexdigest()

    def check_in_sync(self, plan: Optional[BoundedPlan] = None) -> None:
        """Check that every rank of the group holds the same host state (and, if given, the same plan).

        A collective: every rank of the group must call it at the same point.
        Costs two digests (about 0.1 ms for a 32-request plan) and one
        all-gather of four int64 per rank: on the host with gloo, on the
        cache's GPU with NCCL (which then waits for that GPU). Raises
        `RuntimeError` naming the ranks that disagree; the cure is to make
        every rank issue the same `add_source`/`admit`/`commit`/
        `reset_request`/`remove_request` calls in the same order.
        """
        if self.world_size == 1:
            return
        dist = _dist()
        if not dist.is_initialized():
            raise RuntimeError("check_in_sync needs torch.distributed to be initialised")
        group = self.process_group
        if group is None and dist.get_world_size() != self.world_size:
            raise ValueError(
                f"check_in_sync: the cache was built for world_size={self.world_size} without a process_group, "
                f"and the default group has {dist.get_world_size()} ranks; build it with process_group=..."
            )
        with self._lock:
            mine = [_signed64(self.state_digest()), _signed64(plan_digest(plan)) if plan is not None else 0,
                    len(self.slots.requests), self.slots.free_slots]
        # gloo/mpi gather host tensors; other backends (NCCL) gather on the cache's accelerator.
        backend = str(dist.get_backend(group))
        device = self.device if self.device.type not in ("cpu", "meta") and not (
            "gloo" in backend or "mpi" in backend) else torch.device("cpu")
        local = torch.tensor(mine, dtype=torch.int64, device=device)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=group)
        gathered = [tuple(t.tolist()) for t in parts]
        if all(g == gathered[0] for g in gathered):
            return
        what = "host state" if any(g[0] != gathered[0][0] for g in gathered) else "plans"
        groups: dict = {}
        for r, g in enumerate(gathered):
            groups.setdefault(g, []).append(r)
        detail = "; ".join(
            f"ranks {ranks}: state {g[0] & _MASK:016x}, plan {g[1] & _MASK:016x}, {g[2]} requests, {g[3]} free slots"
            for g, ranks in groups.items()
        )
        raise RuntimeError(
            f"flexkv {what} diverged across the {self.world_size} tensor-parallel ranks ({detail}); every rank must "
            f"make the same add_source/admit/commit/reset_request/remove_request calls in the same order"
        )


def all_gather_heads(x: torch.Tensor, group: Any = None, dim: int = 1) -> torch.Tensor:
    """Concatenate every rank's heads of `x` along `dim` (rank order): the full-head tensor.

    A tensor-parallel model does not need this (its output projection is
    row-parallel and ends in an all-reduce); it is for checks and tests.
    """
    dist = _dist()
    world = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
