"""Head sharding without processes: ownership, errors, sources, the engine seam, digests.

Several ranks' caches can live in one process when they are given `rank`
and `world_size` directly; concatenating their outputs along heads must give
the single cache's output.
"""

from __future__ import annotations

import pytest
import torch

from flexkv import BoundedKVConfig, BoundedKVManager, BoundedKVStep, LayerGroup, Segment, SinkWindow, StreamPosition
from flexkv.model.uncached import UncachedHistory
from flexkv.serving import BoundedKVResource, BoundedKVSpec, EngineResourceInfo
from flexkv.serving.distributed import HeadShard, ShardedKVManager, ShardStores, plan_digest, resolve_rank


def small_config(num_heads=4, **kw) -> BoundedKVConfig:
    args = dict(max_slots=3, max_step_tokens=2, max_sources=2)
    args.update(kw)
    return BoundedKVConfig(2, num_heads, 8, 2, 5, SinkWindow(2, 4), **args)


# ------------------------------------------------------------------ ownership


def test_ranks_own_contiguous_heads_and_whole_gqa_groups():
    H, Hq, W = 8, 32, 4
    seen_kv, seen_q = [], []
    for r in range(W):
        s = HeadShard(H, r, W, num_query_heads=Hq)
        assert s.local_heads == 2
        assert s.kv_slice == slice(2 * r, 2 * r + 2)
        assert s.query_slice() == slice(8 * r, 8 * r + 8)
        # every query head of the rank reads (Hq // H groups, repeat_interleave order) one of its KV heads
        assert {hq // (Hq // H) for hq in range(Hq)[s.query_slice()]} == set(range(H)[s.kv_slice])
        seen_kv += list(range(H)[s.kv_slice])
        seen_q += list(range(Hq)[s.query_slice()])
    assert seen_kv == list(range(H)) and seen_q == list(range(Hq))


def test_shard_views_pick_the_rank_heads():
    full = torch.arange(2 * 8 * 3).view(2, 8, 3)
    s = HeadShard(4, 1, 2)
    assert torch.equal(s.query(full), full[:, 4:8])  # 8 query heads, 2 per KV head
    assert torch.equal(s.kv(full[:, :4]), full[:, 2:4])
    with pytest.raises(ValueError, match=r"full 4 KV heads along dim 1"):
        s.kv(full[:, :3])


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(num_heads=6, rank=0, world_size=4), r"num_heads=6 KV heads cannot be split evenly over world_size=4 "
                                                  r"ranks; use a world size that divides 6 \(1, 2, 3, 6\)"),
        (dict(num_heads=2, rank=0, world_size=4, num_query_heads=8),
         r"world_size=4 would split a GQA group across ranks: the 8 query heads read 2 KV heads in groups of 4.*"
         r"divides 2 \(1, 2\)"),
        (dict(num_heads=4, rank=0, world_size=2, num_query_heads=6), r"num_query_heads must be a positive multiple "
                                                                     r"of num_heads=4.*got 6"),
        (dict(num_heads=4, rank=2, world_size=2), r"rank must be an int in \[0, world_size=2\), got 2"),
        (dict(num_heads=4, rank=0, world_size=0), r"world_size must be an int >= 1, got 0"),
    ],
)
def test_bad_splits_are_refused_with_a_fix(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        HeadShard(**kwargs)


def test_resolve_rank_without_a_group():
    assert resolve_rank() == (0, 1)
    assert resolve_rank(rank=3, world_size=4) == (3, 4)
    with pytest.raises(ValueError, match=r"rank=1 was given without world_size"):
        resolve_rank(rank=1)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 5"):
        resolve_rank(rank=5, world_size=2)
    with pytest.raises(ValueError, match=r"world_size must be an int or None, got '2'"):
        resolve_rank(world_size="2")


def test_process_group_needs_an_initialised_torch_distributed():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"torch.distributed is not initialised"):
        resolve_rank(process_group=object())


def test_one_rank_group_in_process(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert resolve_rank(group) == (0, 1)
        with pytest.raises(ValueError, match=r"world_size=2 disagrees with process_group, which has 1 ranks"):
            resolve_rank(group, world_size=2)
        with pytest.raises(ValueError, match=r"rank=1 disagrees with process_group, where this process is rank 0"):
            resolve_rank(group, rank=1)
        m = ShardedKVManager(small_config(), process_group=group, check_plans=True, block_size=16)
        assert m.config.num_heads == 4
        step = BoundedKVStep((Segment("a", 1),), {"a": StreamPosition(0, 0)})
        m.admit(step)
        m.plan(step)  # the check is trivially true on one rank and must not raise
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ the cache


@pytest.mark.parametrize("groups", [None, (LayerGroup((0,), SinkWindow(2, 4)), LayerGroup((1,), SinkWindow(1, 2)))],
                         ids=["one-group", "two-groups"])
def test_shards_in_one_process_reproduce_the_full_cache_and_the_twin(groups):
    """Ranks' shares side by side are the whole cache's output, and the uncached twin's: every layer group keeps
    the rank's heads (a source given whole or already sliced), and every rank plans the same step."""
    torch.manual_seed(7)
    cfg = small_config()
    W, Hq, N = 2, 8, 4
    full = BoundedKVManager(cfg, groups=groups, block_size=16)
    twin = UncachedHistory(cfg, groups)
    shards = [ShardedKVManager(cfg, groups=groups, rank=r, world_size=W, num_query_heads=Hq, block_size=16)
              for r in range(W)]
    assert [g.config.num_heads for s in shards for g in s.cache_groups] == [2] * W * len(full.cache_groups)
    keys, values = torch.randn(2, 2, 4, 5, 8), torch.randn(2, 2, 4, 5, 8)
    twin.add_source(keys, values)
    full.add_source(keys, values)
    for s in shards:  # rank 0 gets the full source, rank 1 its own slice
        s.add_source(keys, values) if s.rank == 0 else s.add_source(s.shard.kv(keys, 2), s.shard.kv(values, 2))
    written = {"a": 0, "b": 0}
    for i in range(7):
        segs = (Segment("a", 2), Segment("b", i % 3)) if i % 2 else (Segment("b", 1), Segment("a", 0))
        pos = {"a": StreamPosition(5, written["a"]), "b": StreamPosition(3, written["b"])}
        step = BoundedKVStep(segs, pos, tokens=2)
        caches = [full] + shards
        for m in caches + [twin]:
            m.admit(step)
        plans = [m.plan(step) for m in caches]
        assert all(p == plans[0] for p in plans)
        twin_plan = twin.plan(step)
        for layer in range(2):
            q, k, v = torch.randn(N, Hq, 2, 8), torch.randn(N, 4, 2, 8), torch.randn(N, 4, 2, 8)
            want = full.attend(layer, q, k, v, plans[0])
            got = torch.cat([s.attend(layer, s.shard.query(q), s.shard.kv(k), s.shard.kv(v), p)
                             for s, p in zip(shards, plans[1:])], dim=1)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(got, twin.attend(layer, q, k, v, twin_plan), atol=1e-5, rtol=1e-4)
        with pytest.raises(ValueError, match=r"q has 8 heads; rank 0 of 2 takes its 4 of the model's 8 query heads"):
            shards[0].attend(1, q, shards[0].shard.kv(k), shards[0].shard.kv(v), plans[1])
        for m in caches + [twin]:
            m.commit(step)
        for seg in segs:
            written[seg.request_id] += seg.span
    assert plan_digest(plans[1]) == plan_digest(plans[2])


def test_full_and_presharded_sources_fill_the_same_cells():
    cfg = small_config()
    keys, values = torch.randn(2, 2, 4, 5, 8), torch.randn(2, 2, 4, 5, 8)
    a = ShardedKVManager(cfg, rank=1, world_size=2, block_size=16)
    b = ShardedKVManager(cfg, rank=1, world_size=2, block_size=16)
    a.add_source(keys, values)
    b.add_source(keys[:, :, 2:].contiguous(), values[:, :, 2:].contiguous())
    for name, buf in a.named_buffers():
        assert torch.equal(buf, dict(b.named_buffers())[name]), name
    assert a.k_cache_0[0, :, :5].equal(keys[0, 0, 2:4])  # source 0, row 0: this rank's heads 2..3


def test_source_with_the_wrong_head_count_is_refused():
    m = ShardedKVManager(small_config(), rank=0, world_size=2, block_size=16)
    good = torch.randn(2, 2, 4, 5, 8)
    with pytest.raises(ValueError, match=r"add_source: keys has 3 heads .*expected the model's 4 KV heads "
                                         r"\(rank 0 keeps heads 0..1\) or this rank's 2 already-sharded heads"):
        m.add_source(torch.randn(2, 2, 3, 5, 8), good)
    with pytest.raises(ValueError, match=r"add_source: values has 1 heads"):
        m.add_source(good, torch.randn(2, 2, 1, 5, 8))
    assert m.sources == {}


def test_attend_wants_this_rank_query_heads():
    m = ShardedKVManager(small_config(), rank=1, world_size=2, num_query_heads=8, block_size=16)
    step = BoundedKVStep((Segment("a", 1),), {"a": StreamPosition(0, 0)})
    m.admit(step)
    plan = m.plan(step)
    k = v = torch.randn(2, 2, 1, 8)
    with pytest.raises(ValueError, match=r"q has 8 heads; rank 1 of 2 takes its 4 of the model's 8 query heads"):
        m.attend(0, torch.randn(2, 8, 1, 8), k, v, plan)
    with pytest.raises(ValueError, match=r"attend: k has all 4 KV heads; rank 1 of 2 takes only its 2"):
        m.attend(0, torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8), v, plan)
    assert m.attend(0, torch.randn(2, 4, 1, 8), k, v, plan).shape == (2, 4, 1, 8)


def test_a_plain_cache_built_with_the_shard_store_factory_is_that_ranks_cache():
    """Tensor parallelism is a store factory: `BoundedKVManager(config, store=ShardStores(shard))` keeps the
    rank's heads of every group, slices full-head sources, refuses every head in `attend`, and attends as the
    rank of `ShardedKVManager` does (which adds only the rank's lookup and the consistency check)."""
    cfg = small_config()
    groups = (LayerGroup((0,), SinkWindow(2, 4)), LayerGroup((1,), SinkWindow(0, 3)))
    plain = BoundedKVManager(cfg, groups=groups, block_size=16,
                             store=ShardStores(HeadShard(4, 1, 2, num_query_heads=8)))
    sharded = ShardedKVManager(cfg, groups=groups, rank=1, world_size=2, num_query_heads=8, block_size=16)
    assert plain.config.num_heads == 2 and [g.config.num_heads for g in plain.cache_groups] == [2, 2]
    keys, values = torch.randn(2, 2, 4, 5, 8), torch.randn(2, 2, 4, 5, 8)
    for m in (plain, sharded):
        m.add_source(keys, values)  # every head given: each keeps heads 2..3
    for name, buf in plain.named_buffers():
        assert torch.equal(buf, dict(sharded.named_buffers())[name]), name
    g = torch.Generator().manual_seed(3)
    for n in range(4):
        step = BoundedKVStep((Segment("a", 2),), {"a": StreamPosition(0, 2 * n)}, tokens=2)
        q = torch.randn(2, 4, 2, 8, generator=g)
        kv = [torch.randn(2, 2, 2, 8, generator=g) for _ in range(4)]
        outs = []
        for m in (plain, sharded):
            m.admit(step)
            plan = m.plan(step)
            outs.append([m.attend(0, q, kv[0], kv[1], plan), m.attend(1, q, kv[2], kv[3], plan)])
            m.commit(step)
        for a, b in zip(*outs):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"attend: k has all 4 KV heads; rank 1 of 2 takes only its 2"):
        plain.attend(0, q, torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8), plain.plan(step))


# ------------------------------------------------------------------ the engine seam


def test_engine_builds_the_plain_cache_by_default():
    spec = BoundedKVSpec("kv", config=small_config(dtype=None))
    m = BoundedKVResource().build(spec, EngineResourceInfo("cpu", torch.float16))
    assert type(m) is BoundedKVManager
    assert m.config.num_heads == 4 and m.config.dtype == torch.float16


def test_engine_builds_this_rank_share():
    spec = BoundedKVSpec("kv", config=small_config(dtype=None))
    whole = BoundedKVResource().build(spec, EngineResourceInfo("cpu", torch.float16))
    m = BoundedKVResource().build(spec, EngineResourceInfo("cpu", torch.float16, rank=3, world_size=4))
    assert isinstance(m, ShardedKVManager)
    assert (m.rank, m.world_size, m.config.num_heads, m.full_config.num_heads) == (3, 4, 1, 4)
    assert m.config.dtype == torch.float16 and m.k_cache_0.dtype == torch.float16
    assert m.memory_bytes * 4 == whole.memory_bytes
    assert m.slot_bytes * 4 == whole.slot_bytes
    with pytest.raises(ValueError, match=r"num_heads=4 KV heads cannot be split evenly over world_size=3"):
        BoundedKVResource().build(spec, EngineResourceInfo("cpu", torch.float16, rank=0, world_size=3))


# ------------------------------------------------------------------ digests


def test_digests_follow_plans_and_host_state():
    cfg = small_config()
    a = ShardedKVManager(cfg, rank=0, world_size=2, block_size=16)
    b = ShardedKVManager(cfg, rank=1, world_size=2, block_size=16)
    step = BoundedKVStep((Segment("x", 1), Segment("y", 2)),
                         {"x": StreamPosition(0, 0), "y": StreamPosition(0, 0)}, tokens=2)
    for m in (a, b):
        m.admit(step)
    assert a.state_digest() == b.state_digest()
    assert plan_digest(a.plan(step)) == plan_digest(b.plan(step))
    b.commit(step)
    assert a.state_digest() != b.state_digest()
    a.commit(step)
    assert a.state_digest() == b.state_digest()
    swapped = BoundedKVStep((Segment("y", 2), Segment("x", 1)), step.positions, tokens=2)
    assert plan_digest(a.plan(swapped)) != plan_digest(a.plan(step))
    b.remove_request("x")
    assert a.state_digest() != b.state_digest()


def test_check_in_sync_needs_torch_distributed_on_several_ranks():
    m = ShardedKVManager(small_config(), rank=0, world_size=2, block_size=16)
    with pytest.raises(RuntimeError, match=r"needs torch.distributed to be initialised"):
        m.check_in_sync()
