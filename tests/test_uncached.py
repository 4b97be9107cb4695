"""`UncachedHistory`, the uncached twin models are checked against, checked itself:
against `flexkv.model.reference.ReferenceCache` without rotary, and against a literal
StreamingLLM cache with rotary in-cache positions. Host-only, no FlexAttention."""

import random

import pytest
import torch

from flexkv import BoundedKVConfig, BoundedKVStep, Segment, SinkWindow, StreamPosition
from flexkv.cache.positions.rotary import Rotary
from flexkv.model.reference import ReferenceCache
from flexkv.model.uncached import UncachedHistory
from single_thread import one_thread  # noqa: F401  (autouse: one torch thread per module)
from streamingllm import StreamingLLM

L_, R, H, HQ, D = 2, 2, 2, 4, 8


def _bias(score, b, h, q_pos, kv_pos):
    return score + 0.05 * (h + 1) * (q_pos - kv_pos).abs().clamp(max=9)


@pytest.mark.parametrize("reverse,query_window,positions", [
    (False, None, "stream"), (True, None, "cache"), (False, 5, "cache"), (False, 5, "stream")])
def test_matches_reference_cache(reverse, query_window, positions):
    rng = random.Random(7)
    torch.manual_seed(7)
    retention = (lambda L: SinkWindow(2, 6)) if query_window is None else SinkWindow(2, 6)
    cfg = BoundedKVConfig(L_, H, D, R, 5, retention, max_slots=4, max_step_tokens=4,
                          reverse_step_order=reverse, query_window=query_window, min_source_len=0)
    ref, unc = ReferenceCache(cfg), UncachedHistory(cfg)
    ks, vs = torch.randn(L_, R, H, 5, D), torch.randn(L_, R, H, 5, D)
    ref.add_source(0, ks, vs)
    assert unc.add_source(ks, vs) == 0
    streams = {"a": [3, 0], "b": [0, 0], "c": [5, 0]}
    for _ in range(12):
        T = rng.randint(1, 4)
        segs, pos = [], {}
        for rid, (L, w) in streams.items():
            span = rng.randint(0, T) if query_window is None else T
            segs.append(Segment(rid, span))
            pos[rid] = StreamPosition(L, w)
        segs.insert(1, Segment(None, 0))
        step = BoundedKVStep(tuple(segs), pos, tokens=T)
        unc.admit(step)
        N = len(segs) * R
        for layer in range(L_):
            q, k, v = torch.randn(N, HQ, T, D), torch.randn(N, H, T, D), torch.randn(N, H, T, D)
            exp = ref.attend(layer, q, k, v, step, score_mod=_bias, positions=positions)
            got = unc.attend(layer, q, k, v, step, score_mod=_bias, positions=positions)
            assert got.dtype == torch.float32
            assert (got.double() - exp).abs().max() < 1e-5
        ref.commit(step); unc.commit(step)
        for s in segs:
            if s.request_id:
                streams[s.request_id][1] += s.span
    assert min(w for _, w in streams.values()) > 6  # past the window


def test_rotary_cache_positions_match_streamingllm():
    torch.manual_seed(8)
    cfg = BoundedKVConfig(L_, H, D, R, 0, SinkWindow(3, 5), max_slots=2)
    rot = Rotary(D, base=50.0)
    unc, by_stream, sllm = UncachedHistory(cfg), UncachedHistory(cfg), StreamingLLM(rot, 3, 5, D ** -0.5)
    pre = UncachedHistory(cfg)  # fed q and k rotated at stream positions, as transformers models give them
    turns = []
    for layer in range(L_):
        unc.rotation(layer, rot, "cache")
        by_stream.rotation(layer, rot, "stream")
        turns.append(pre.rotation(layer, rot, "cache", rotated_inputs=True))
    for n in range(20):
        step = BoundedKVStep((Segment("a", 1),), {"a": StreamPosition(0, n)})
        unc.admit(step)
        by_stream.admit(step)
        pre.admit(step)
        for layer in range(L_):
            q, k, v = torch.randn(R, HQ, 1, D), torch.randn(R, H, 1, D), torch.randn(R, H, 1, D)
            got = unc.attend(layer, q, k, v, step)
            at = torch.full((R, 1), n)
            q_in, k_in = turns[layer](rot.rotate(q, at), rot.rotate(k, at), step)
            assert (pre.attend(layer, q_in, k_in, v, step) - got).abs().max() < 1e-5
            assert (got.double() - sllm.attend(layer, "a", q, k, v)).abs().max() < 1e-5
            stream = by_stream.attend(layer, q, k, v, step)
            if n > 3 + 5:  # evicting: the two position modes part
                assert (stream - got).abs().max() > 1e-3
        unc.commit(step)
        by_stream.commit(step)
        pre.commit(step)


def test_rejects_stale_positions_and_bad_modes():
    cfg = BoundedKVConfig(1, H, D, 1, 0, SinkWindow(1, 2), max_slots=2)
    unc = UncachedHistory(cfg)
    with pytest.raises(ValueError, match="written=3 but 0 tokens are committed"):
        unc.admit(BoundedKVStep((Segment("a", 1),), {"a": StreamPosition(0, 3)}))
    step = BoundedKVStep((Segment("a", 1),), {"a": StreamPosition(0, 0)})
    x = torch.zeros(1, H, 1, D)
    with pytest.raises(ValueError, match="rotation: mode must be one of"):
        unc.rotation(0, Rotary(D), "absolute")
    with pytest.raises(ValueError, match="attend: positions must be one of"):
        unc.attend(0, x, x, x, step, positions="cells")


def test_attend_takes_the_protocols_keywords():
    """As `BoundedKVManager.attend`: every argument by keyword, `plan` the one `plan(step)` returned."""
    cfg = BoundedKVConfig(num_layers=2, num_heads=1, head_dim=4, rows_per_request=1, max_source_len=0,
                          retention=SinkWindow(1, 2), max_slots=1, dtype=torch.float64)
    cache = UncachedHistory(cfg)
    g = torch.Generator().manual_seed(0)
    for written in range(5):
        step = BoundedKVStep((Segment("a", 1),), {"a": StreamPosition(0, written)})
        cache.admit(step)
        given = cache.plan(step)
        q, k, v = (torch.randn(1, 1, 1, 4, generator=g, dtype=torch.float64) for _ in range(3))
        implicit = cache.attend(layer_idx=1, q=q, k=k, v=v, plan=given)
        explicit = cache.attend(0, q, k, v, given)
        torch.testing.assert_close(implicit, explicit, rtol=0, atol=0)
        cache.commit(step)
