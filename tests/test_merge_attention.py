"""Keys of several caches in one softmax: `attend_lse`, query-only queries and
`flexkv.cache.paths.merge.merge_attention`.

The oracle for a cache's log-sum-exp and its query-only queries is the dense
reference (`flexkv.model.reference.ReferenceCache`, float64); the oracle for
two caches merged into one softmax is a softmax over the union of their keys
written out in plain torch over the whole history.
"""

from functools import partial

import pytest
import torch
from random_workload import check_close

from configs import small_config
from flexkv import BoundedKVManager, BoundedKVStep, Segment, SinkWindow, StreamPosition, UncachedHistory
from flexkv.cache.paths.attention_options import AttentionOptions
from flexkv.cache.paths.merge import merge_attention
from flexkv.cache.storage.quantized import round_trip
from flexkv.model.reference import ReferenceCache
from single_thread import one_thread  # noqa: F401

H, HQ, D = 2, 4, 8


# ------------------------------------------------------------------ merge_attention


def _part(q, keys, values, allowed):
    """Attention of `q [Q, D]` over `keys [K, D]` where `allowed [Q, K]`: `(out, lse)` written out."""
    scores = (q @ keys.T).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.where(allowed, torch.exp(scores - lse.unsqueeze(-1).clamp_min(-1e30)), 0.0)
    return torch.nan_to_num(probs) @ values, lse


def test_two_disjoint_key_sets_merge_into_the_softmax_over_their_union():
    g = torch.Generator().manual_seed(0)
    q, keys, values = (torch.randn(n, D, generator=g, dtype=torch.float64) * 2 for n in (5, 9, 9))
    allowed = torch.rand(5, 9, generator=g) > 0.3
    allowed[1, :4] = False  # query 1 reads nothing of part A
    allowed[4] = False  # query 4 reads nothing at all
    a, b = _part(q, keys[:4], values[:4], allowed[:, :4]), _part(q, keys[4:], values[4:], allowed[:, 4:])
    out, lse = merge_attention(a, b)
    want, want_lse = _part(q, keys, values, allowed)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)
    torch.testing.assert_close(out[1], b[0][1], rtol=0, atol=1e-12)  # all of it from part B
    assert torch.equal(out[4], torch.zeros(D, dtype=torch.float64)) and lse[4] == float("-inf")


def test_merging_keeps_the_output_dtype_and_refuses_parts_of_other_queries():
    out = torch.zeros(2, 3, 4, dtype=torch.bfloat16)
    lse = torch.zeros(2, 3)
    merged, merged_lse = merge_attention((out, lse), (out, lse))
    assert merged.dtype == torch.bfloat16 and merged_lse.dtype == torch.float32
    torch.testing.assert_close(merged_lse, torch.full((2, 3), torch.log(torch.tensor(2.0)).item()))
    with pytest.raises(ValueError, match=r"part 1's output is \(2, 3, 5\) torch.bfloat16, part 0's \(2, 3, 4\)"):
        merge_attention((out, lse), (torch.zeros(2, 3, 5, dtype=torch.bfloat16), lse))
    with pytest.raises(ValueError, match=r"part 0's log-sum-exp must be \(2, 3\)"):
        merge_attention((out, torch.zeros(2, 4)))
    with pytest.raises(ValueError, match="at least one"):
        merge_attention()


# ------------------------------------------------------------------ one cache: lse and query-only


_config = partial(small_config, num_layers=1, num_heads=H, head_dim=D, max_source_len=2, max_sources=1)


CASES = {
    "rows": dict(),
    "flex": dict(path="flex"),
    "causal-chunks": dict(config=dict(causal_step=True, retention=SinkWindow.keys(7, sink=2))),
    "reversed": dict(config=dict(reverse_step_order=True)),
    "query-window": dict(config=dict(query_window=5)),
    "int8": dict(config=dict(slot_dtype=torch.int8)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("front", ["bounded", "uncached"])
def test_log_sum_exp_and_query_only_queries_match_the_reference(case, front):
    """Ring wraps, a source, sinks, GQA, short and full steps: every output and log-sum-exp of the
    step's queries and of two query-only queries per row equal the dense reference's."""
    spec = CASES[case]
    cfg = _config(**spec.get("config", {}))
    if front == "bounded":
        cache = BoundedKVManager(cfg, "cpu", block_size=8,
                                 options=AttentionOptions.for_cache(cfg, "cpu", path=spec.get("path", "auto")))
    else:
        cache = UncachedHistory(cfg)
    ref = ReferenceCache(cfg)
    g = torch.Generator().manual_seed(5)
    src = [torch.randn(1, 1, H, 2, D, generator=g) for _ in range(2)]
    ref.add_source(cache.add_source(*src), *(round_trip(x, cfg.slot_dtype) for x in src))
    sinks = torch.randn(HQ, generator=g)
    written = {"a": 0, "b": 0}
    T = cfg.max_step_tokens
    for s in range(10):
        spans = {"a": 1 + s % T, "b": T}
        step = BoundedKVStep(tuple(Segment(r, n) for r, n in spans.items()),
                             {"a": StreamPosition(2, written["a"], source=0), "b": StreamPosition(0, written["b"])},
                             tokens=T)
        cache.admit(step)
        q, k, v = (torch.randn(2, h, T, D, generator=g) for h in (HQ, H, H))
        q2 = torch.randn(2, HQ, 2, D, generator=g)
        kw = dict(sinks=sinks if s % 2 else None)
        out, lse = cache.attend_query_only(0, q, k, v, cache.plan(step), q2, **kw)
        (out, out2), (lse, lse2) = out.split([T, 2], dim=2), lse.split([T, 2], dim=2)
        (want, want_lse), (want2, want_lse2) = ref.attend(0, q, round_trip(k, cfg.slot_dtype), round_trip(v, cfg.slot_dtype),
                                                         step, return_lse=True, query_only=q2, **kw)
        for r, n in spans.items():
            b = list(spans).index(r)
            where = f"{case}/{front} step {s} request {r}"
            check_close(out[b, :, :n], want[b, :, :n], 1e-5, where)
            check_close(lse[b, :, :n], want_lse[b, :, :n], 1e-5, where + " lse")
            check_close(out2[b], want2[b], 1e-5, where + " query-only")
            check_close(lse2[b], want_lse2[b], 1e-5, where + " query-only lse")
        cache.commit(step)
        ref.commit(step)
        for r, n in spans.items():
            written[r] += n
    assert written["b"] > 2 * cfg.window_capacity  # the ring wrapped


def test_a_query_only_query_attends_as_the_newest_own_token_would():
    """In stream order, a query-only copy of the last token's query gets that token's output."""
    cfg = _config(causal_step=True, retention=SinkWindow.keys(7, sink=2), min_source_len=0)
    m = BoundedKVManager(cfg, "cpu", block_size=8)
    g = torch.Generator().manual_seed(2)
    written = 0
    for s in range(6):
        step = BoundedKVStep((Segment("a", 3),), {"a": StreamPosition(0, written)}, tokens=3)
        m.admit(step)
        q, k, v = (torch.randn(1, h, 3, D, generator=g) for h in (HQ, H, H))
        out = m.attend_query_only(0, q, k, v, m.plan(step), q[:, :, 2:].clone()).out  # the step's 3, then the copy
        torch.testing.assert_close(out[:, :, 3], out[:, :, 2], rtol=0, atol=1e-6)
        assert not torch.allclose(out[:, :, 0], out[:, :, 2])  # the first token reads less
        m.commit(step)
        written += 3


def test_bad_query_only_queries_are_refused_before_anything_is_written():
    cfg = _config(min_source_len=0)
    m = BoundedKVManager(cfg, "cpu", block_size=8)
    step = BoundedKVStep((Segment("a", 1),), {"a": StreamPosition(0, 0)}, tokens=1)
    m.admit(step)
    plan = m.plan(step)
    q, k, v = torch.ones(1, HQ, 1, D), torch.ones(1, H, 1, D), torch.ones(1, H, 1, D)
    before = m.k_cache_0.clone()
    with pytest.raises(ValueError, match=r"query_only must be \[N=1, heads=4, Q>=1, head_dim=8\] like q"):
        m.attend_query_only(0, q, k, v, plan, torch.ones(1, H, 2, D))
    with pytest.raises(ValueError, match="query_only must have q's dtype"):
        m.attend_query_only(0, q, k, v, plan, torch.ones(1, HQ, 2, D, dtype=torch.float64))
    assert torch.equal(m.k_cache_0, before)


# ------------------------------------------------------------------ two caches in one softmax


def test_a_segment_and_a_bank_of_segment_summaries_attend_as_one_softmax():
    """An Emformer-shaped layer on two caches, each at its own retention. Per segment of C frames:
    the frames attend their left context (W frames), the segment itself and the bank of the last M
    summaries, in one softmax; the segment's summary query (the mean of its frames, a query only)
    attends the left context and the segment; its output is written to the bank at the next
    segment. Checked against that rule written out over the whole history."""
    C, W, M, segments = 4, 8, 3, 9
    frames = BoundedKVManager(_config(min_source_len=0, max_source_len=0, max_sources=0, retention=SinkWindow(0, W),
                                      max_step_tokens=C), "cpu", block_size=8)
    # The bank's window counts the step's own entry: the newest summary and the M - 1 before it.
    bank = BoundedKVManager(_config(min_source_len=0, max_source_len=0, max_sources=0, max_step_tokens=1,
                                    retention=SinkWindow(0, M, window_includes_step=True)), "cpu", block_size=8)
    g = torch.Generator().manual_seed(7)
    wq, wk, wv = (torch.randn(D, D, generator=g, dtype=torch.float64) / D ** 0.5 for _ in range(3))
    proj = lambda x, w, heads: (x @ w).view(-1, 1, D).expand(-1, heads, D)  # noqa: E731 (one head, repeated)
    hist_k, hist_v, bank_k, bank_v = [], [], [], []
    summary_out = torch.zeros(D, dtype=torch.float64)
    for s in range(segments):
        x = torch.randn(C, D, generator=g, dtype=torch.float64)
        # The bank first: the previous segment's summary output joins it (a zero vector at the start).
        bstep = BoundedKVStep((Segment("a", 1),), {"a": StreamPosition(0, s)}, tokens=1)
        bank.admit(bstep)
        bk, bv = proj(summary_out[None], wk, H), proj(summary_out[None], wv, H)
        q_frames = proj(x, wq, HQ)  # [C, HQ, D]
        both = bank.attend_query_only(
            0, torch.zeros(1, HQ, 1, D), bk.transpose(0, 1)[None].float(), bv.transpose(0, 1)[None].float(),
            bank.plan(bstep), q_frames.transpose(0, 1)[None].float())
        bank_out, bank_lse = both.out[:, :, 1:], both.lse[:, :, 1:]  # after the bank step's own query
        bank.commit(bstep)
        fstep = BoundedKVStep((Segment("a", C),), {"a": StreamPosition(0, s * C)}, tokens=C)
        frames.admit(fstep)
        k, v = proj(x, wk, H), proj(x, wv, H)
        q_sum = proj(x.mean(0, keepdim=True), wq, HQ)
        both = frames.attend_query_only(
            0, q_frames.transpose(0, 1)[None].float(), k.transpose(0, 1)[None].float(),
            v.transpose(0, 1)[None].float(), frames.plan(fstep), q_sum.transpose(0, 1)[None].float())
        own_out, own_lse, sum_out = both.out[:, :, :C], both.lse[:, :, :C], both.out[:, :, C:]
        frames.commit(fstep)
        out, _ = merge_attention((own_out, own_lse), (bank_out, bank_lse))
        # The rule written out over the whole history (head 0; every head is the same here).
        bank_k.append(bk[0, 0]), bank_v.append(bv[0, 0])
        hist_k.append(k[:, 0]), hist_v.append(v[:, 0])
        K = torch.cat([torch.stack(bank_k[-M:]), torch.cat(hist_k)[-(W + C):]])
        V = torch.cat([torch.stack(bank_v[-M:]), torch.cat(hist_v)[-(W + C):]])
        scale = D ** -0.5
        want = torch.softmax(q_frames[:, 0] @ K.T * scale, -1) @ V
        check_close(out[0, 0].double(), want, 1e-5, f"segment {s} frames")
        keys, vals = torch.cat(hist_k)[-(W + C):], torch.cat(hist_v)[-(W + C):]
        want_sum = torch.softmax(q_sum[:, 0] @ keys.T * scale, -1) @ vals
        check_close(sum_out[0, 0].double(), want_sum, 1e-5, f"segment {s} summary")
        summary_out = sum_out[0, 0, 0].double()
    assert segments * C > 2 * (W + C) and segments > 2 * M  # both rings wrapped


def test_compiled_log_sum_exp_and_query_only_match_the_reference_without_recompiling():
    from torch._dynamo.utils import counters

    cfg = _config(min_source_len=0, retention=SinkWindow(2, 6))
    m = BoundedKVManager(cfg, "cpu", block_size=16)
    ref = ReferenceCache(cfg)

    def layer(q, k, v, q2, plan):
        return m.attend_query_only(0, q, k, v, plan, q2)

    compiled = torch.compile(layer, fullgraph=True)
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(9)
    written = 0
    for s in range(12):
        step = BoundedKVStep((Segment("a", 1), Segment(None, 0)), {"a": StreamPosition(0, written)}, tokens=1)
        m.admit(step)
        q, k, v = (torch.randn(2, h, 1, D, generator=g) for h in (HQ, H, H))
        q2 = torch.randn(2, HQ, 3, D, generator=g)
        with torch._dynamo.config.patch(error_on_recompile=s > 0):
            out, lse = compiled(q, k, v, q2, m.plan(step))
        (out, out2), (lse, lse2) = out.split([1, 3], dim=2), lse.split([1, 3], dim=2)
        (want, want_lse), (want2, want_lse2) = ref.attend(0, q, k, v, step, return_lse=True, query_only=q2)
        for got, exp, name in ((out, want, "out"), (lse, want_lse, "lse"), (out2, want2, "query-only"),
                               (lse2, want_lse2, "query-only lse")):
            check_close(got[:1], exp[:1], 1e-5, f"step {s} {name}")
        m.commit(step)
        ref.commit(step)
        written += 1
    assert counters["stats"]["unique_graphs"] == 1
