"""Tensor-parallel flexkv across real processes (gloo on CPU).

One deterministic workload (requests arriving, finishing, being reset, two
sources, padding rows, spans from 0 to T) is streamed through:

- a sharded cache on every rank of a 4-process gloo group and of a 2-rank
  subgroup of it, built through `BoundedKVResource` with the group in
  `EngineResourceInfo`; every rank attends its own heads and the outputs are
  all-gathered along heads;
- a single-process cache on the full heads;
- `flexkv.model.reference` (float64, whole streams).

The gathered outputs must match both, and every rank's plans must equal the
single-process plans. At the end the ranks diverge on purpose, and the
consistency check must catch it on every rank.

Workers regenerate the workload from its seed, so nothing but results
crosses process boundaries.
"""

from __future__ import annotations

import os
import random
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

from flexkv import BoundedKVConfig, BoundedKVManager, BoundedKVStep, Segment, SinkWindow, StreamPosition
from flexkv.model.reference import ReferenceCache
from flexkv.serving import BoundedKVResource, BoundedKVSpec, EngineResourceInfo

LAYERS, HEADS, QUERY_HEADS, HEAD_DIM, ROWS = 2, 4, 8, 8, 2
SLOTS, BATCH, STEPS, SEED = 4, 3, 24, 1234
T = 3
SOURCE_LENS = (6, 4)  # source 0 is given to add_source with every head, source 1 already sharded


def _retention(source_len: int) -> SinkWindow:
    if source_len % 2:
        return SinkWindow(1, 6, window_includes_step=True)
    return SinkWindow(3, 5)


def make_config(dtype=torch.float32) -> BoundedKVConfig:
    return BoundedKVConfig(
        LAYERS, HEADS, HEAD_DIM, ROWS, max(SOURCE_LENS), _retention,
        max_slots=SLOTS, max_step_tokens=T, max_sources=len(SOURCE_LENS), dtype=dtype,
    )


def make_workload(seed: int = SEED):
    """Full-head sources and a list of steps: (removals, resets, step, [(q, k, v) per layer])."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    sources = [
        (torch.randn(LAYERS, ROWS, HEADS, n, HEAD_DIM, generator=gen),
         torch.randn(LAYERS, ROWS, HEADS, n, HEAD_DIM, generator=gen))
        for n in SOURCE_LENS
    ]
    active: dict = {}  # rid -> [source, source_len, written]
    admitted: set = set()  # requests that ran at least once (so the cache knows them)
    counter = 0
    steps = []
    for _ in range(STEPS):
        removals, resets = [], []
        if admitted and rng.random() < 0.25:
            rid = rng.choice(sorted(admitted))
            del active[rid]
            admitted.discard(rid)
            removals.append(rid)
        if admitted and rng.random() < 0.15:
            rid = rng.choice(sorted(admitted))
            src = rng.randrange(len(SOURCE_LENS))
            active[rid] = [src, rng.randint(0, SOURCE_LENS[src]), 0]
            resets.append(rid)
        while len(active) < SLOTS and rng.random() < 0.6:
            src = rng.randrange(len(SOURCE_LENS))
            active[f"r{counter}"] = [src, rng.randint(0, SOURCE_LENS[src]), 0]
            counter += 1
        running = rng.sample(sorted(active), min(len(active), rng.randint(1, BATCH)))
        # one batch shape (T tokens per row) for the whole stream; spans below T leave look-ahead tokens
        segs = [Segment(rid, rng.randint(0, T)) for rid in running]
        while len(segs) < BATCH:
            segs.insert(rng.randint(0, len(segs)), Segment(None, 0))
        positions = {rid: StreamPosition(active[rid][1], active[rid][2], source=active[rid][0]) for rid in running}
        step = BoundedKVStep(tuple(segs), positions, tokens=T)
        N = BATCH * ROWS
        qkv = [
            (torch.randn(N, QUERY_HEADS, T, HEAD_DIM, generator=gen),
             torch.randn(N, HEADS, T, HEAD_DIM, generator=gen),
             torch.randn(N, HEADS, T, HEAD_DIM, generator=gen))
            for _ in range(LAYERS)
        ]
        for seg in segs:
            if seg.request_id is not None:
                active[seg.request_id][2] += seg.span
                admitted.add(seg.request_id)
        steps.append((removals, resets, step, qkv))
    return sources, steps


def _diverge(m, world: int, rank: int) -> dict:
    """Make the last rank drift from the others, twice; return each check's error message (or None)."""
    for rid in m.requests:
        m.remove_request(rid)
    last = rank == world - 1
    pad = Segment(None, 0)
    out = {}
    # 1. same host state, different step: the last rank's model disagrees about a span.
    step = BoundedKVStep((Segment("p", 2 if last else 1), pad, pad), {"p": StreamPosition(0, 0)}, tokens=2)
    m.admit(step)
    try:
        m.plan(step)
        out["plans"] = None
    except RuntimeError as exc:
        out["plans"] = str(exc)
    # 2. different host state: only the last rank frees "p", so "z" gets a different slot there.
    if last:
        m.remove_request("p")
    step = BoundedKVStep((Segment("z", 1), pad, pad), {"z": StreamPosition(0, 0)})
    m.admit(step)
    try:
        m.plan(step)
        out["state"] = None
    except RuntimeError as exc:
        out["state"] = str(exc)
    return out


def _stream(group, world: int, rank: int) -> dict:
    """Run the workload through this rank's share of a cache built for `group`; return what the test checks."""
    from flexkv.serving.distributed import ShardedKVManager, all_gather_heads

    spec = BoundedKVSpec("attention", config=make_config(dtype=None))
    m = BoundedKVResource().build(spec, EngineResourceInfo("cpu", torch.float32, process_group=group))
    assert isinstance(m, ShardedKVManager), type(m)
    assert (m.rank, m.world_size) == (rank, world), (m.rank, m.world_size)
    m.check_plans = True  # every plan below is also compared across ranks
    sources, steps = make_workload()
    keys, values = sources[0]
    m.add_source(keys, values)  # full heads: the cache keeps this rank's slice
    keys, values = sources[1]
    m.add_source(m.shard.kv(keys, dim=2).clone(), m.shard.kv(values, dim=2).clone())  # already sharded
    hosts, outputs = [], []
    for removals, resets, step, qkv in steps:
        for rid in removals:
            m.remove_request(rid)
        for rid in resets:
            m.reset_request(rid)
        m.admit(step)
        plan = m.plan(step)
        hosts.append(plan.host)
        per_layer = []
        for layer, (q, k, v) in enumerate(qkv):
            out = m.attend(layer, m.shard.query(q), m.shard.kv(k), m.shard.kv(v), plan)
            per_layer.append(all_gather_heads(out, group))
        outputs.append(per_layer)
        m.commit(step)
    return {
        "rank": rank,
        "hosts": hosts,
        "outputs": outputs if rank == 0 else None,
        "heads": m.config.num_heads,
        "kv_slice": (m.shard.kv_slice.start, m.shard.kv_slice.stop),
        "memory_bytes": m.memory_bytes,
        "slot_bytes": m.slot_bytes,
        "diverged": _diverge(m, world, rank),
    }


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """One process of the gloo job: the workload on all `world` ranks, then on a 2-rank subgroup."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    # A collective that some rank never reaches fails after the timeout instead of hanging the suite.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        result = _stream(dist.group.WORLD, world, rank)
        torch.save(result, os.path.join(out_dir, f"tp{world}_rank{rank}.pt"))
        pair = dist.new_group([0, 1])  # every process takes part in creating a group
        if rank < 2:
            result = _stream(pair, 2, rank)
            torch.save(result, os.path.join(out_dir, f"tp2_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def single():
    """The workload on one process: full-head cache outputs and plans, and the float64 reference."""
    cfg = make_config()
    m = BoundedKVManager(cfg, "cpu")
    ref = ReferenceCache(cfg)
    sources, steps = make_workload()
    for keys, values in sources:
        ref.add_source(m.add_source(keys, values), keys, values)
    hosts, outputs, expected = [], [], []
    for removals, resets, step, qkv in steps:
        for rid in removals:
            m.remove_request(rid)
            ref.remove_request(rid)
        for rid in resets:
            m.reset_request(rid)
            ref.reset_request(rid)
        m.admit(step)
        plan = m.plan(step)
        hosts.append(plan.host)
        outputs.append([m.attend(layer, q, k, v, plan) for layer, (q, k, v) in enumerate(qkv)])
        expected.append([ref.attend(layer, q, k, v, step) for layer, (q, k, v) in enumerate(qkv)])
        m.commit(step)
        ref.commit(step)
    return {"hosts": hosts, "outputs": outputs, "expected": expected, "memory_bytes": m.memory_bytes,
            "slot_bytes": m.slot_bytes}


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory):
    """Spawn 4 processes once; they stream the workload as a 4-rank group and then as a 2-rank subgroup.

    Sharing the processes halves the start-up cost (importing torch, warming
    FlexAttention up) on a small CI machine, and the 2-rank run goes through a
    process group that is not the default one.
    """
    out = tmp_path_factory.mktemp("tp")
    mp.spawn(_worker, args=(4, str(out / "rendezvous"), str(out)), nprocs=4, join=True)
    return {
        world: [torch.load(out / f"tp{world}_rank{r}.pt", weights_only=False) for r in range(world)]
        for world in (2, 4)
    }


@pytest.fixture(params=[2, 4], ids=lambda w: f"world{w}")
def ranks(request, gloo_runs):
    return request.param, gloo_runs[request.param]


def test_workload_exercises_churn():
    """The workload really has removals, resets, padding, reads-only rows and both sources."""
    _, steps = make_workload()
    assert sum(len(r) for r, _, _, _ in steps) >= 3
    assert sum(len(s) for _, s, _, _ in steps) >= 2
    segs = [seg for _, _, step, _ in steps for seg in step.segments]
    assert any(seg.request_id is None for seg in segs)
    assert any(seg.request_id is not None and seg.span == 0 for seg in segs)
    used = {pos.source for _, _, step, _ in steps for pos in step.positions.values() if pos.source_len}
    assert used == {0, 1}


def test_gathered_heads_match_single_process_and_reference(ranks, single):
    world, results = ranks
    outputs = results[0]["outputs"]
    assert len(outputs) == STEPS
    for i in range(STEPS):
        for layer in range(LAYERS):
            got = outputs[i][layer]
            assert got.shape == (BATCH * ROWS, QUERY_HEADS, got.shape[2], HEAD_DIM)
            torch.testing.assert_close(got, single["outputs"][i][layer], msg=lambda m: f"step {i} layer {layer}: {m}")
            torch.testing.assert_close(
                got.double(), single["expected"][i][layer], atol=1e-5, rtol=1e-4,
                msg=lambda m: f"step {i} layer {layer} vs reference: {m}",
            )


def test_every_rank_plans_like_the_single_process(ranks, single):
    world, results = ranks
    for res in results:
        assert res["hosts"] == single["hosts"], f"rank {res['rank']} planned differently"


def test_each_rank_holds_its_share_of_heads_and_memory(ranks, single):
    world, results = ranks
    local = HEADS // world
    assert [r["kv_slice"] for r in results] == [(r * local, (r + 1) * local) for r in range(world)]
    for res in results:
        assert res["heads"] == local
        assert res["memory_bytes"] * world == single["memory_bytes"]
        assert res["slot_bytes"] * world == single["slot_bytes"]


def test_divergence_is_detected_on_every_rank(ranks):
    world, results = ranks
    for res in results:
        plans, state = res["diverged"]["plans"], res["diverged"]["state"]
        assert plans is not None and "plans diverged" in plans, plans
        assert f"ranks [{world - 1}]" in plans and f"ranks {list(range(world - 1))}" in plans, plans
        assert state is not None and "host state diverged" in state, state
        assert f"ranks [{world - 1}]" in state, state
