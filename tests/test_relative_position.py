"""Relative-position attention (`flexkv.cache.positions.relative_position`) against the conformer's own attention.

The reference is ESPnet's `RelPositionMultiHeadedAttention` ("latest" relative
encoding) written out in plain torch over the whole utterance: the encoding
table of distances `T - 1 .. -(T - 1)` built from a positive and a flipped
negative half, the `rel_shift` trick that turns `(q + v) . p` over that table
into the `[i, j]` term, and the chunk mask of a streaming conformer (a chunk
reads its look-ahead and a window of earlier frames). flexkv streams the same
module chunk by chunk, its position term a per-step table read at the
stream distance, on every attention path, eager and compiled.
"""

import math

import pytest
import torch
from random_workload import check_close
from torch import nn

from flexkv import (
    BoundedKVConfig,
    BoundedKVManager,
    BoundedKVStep,
    Segment,
    SinkWindow,
    StreamPosition,
    UncachedHistory,
)
from flexkv.cache.paths.attention_options import AttentionOptions
from flexkv.cache.positions.relative_position import RelativePosition, RelativePositionScores, distance_range
from single_thread import one_thread  # noqa: F401  (autouse: one torch thread per module)

C, LA, W = 4, 2, 8  # chunk, look-ahead frames, window of earlier frames
T = C + LA
H, DK = 2, 8
DIM = H * DK
TOL = 1e-5


def espnet_pe(length: int, dim: int) -> torch.Tensor:
    """ESPnet's relative encoding for a sequence of `length`: `[2 length - 1, dim]`, row `k` at distance `length - 1 - k`."""
    pos = torch.arange(length, dtype=torch.float64).unsqueeze(1)
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * -(math.log(10000.0) / dim))
    pe_pos = torch.zeros(length, dim, dtype=torch.float64)
    pe_neg = torch.zeros(length, dim, dtype=torch.float64)
    pe_pos[:, 0::2], pe_pos[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
    pe_neg[:, 0::2], pe_neg[:, 1::2] = torch.sin(-pos * div), torch.cos(-pos * div)
    return torch.cat([torch.flip(pe_pos, [0]), pe_neg[1:]], dim=0).float()


def encode_distance(d: torch.Tensor, dim: int) -> torch.Tensor:
    """The same encoding evaluated at signed distances `d`: `[len(d), dim]` (what a flexkv port computes)."""
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * -(math.log(10000.0) / dim))
    ang = d.double().unsqueeze(1) * div
    return torch.stack([ang.sin(), ang.cos()], dim=-1).flatten(1).float()


def rel_shift(x: torch.Tensor) -> torch.Tensor:
    """`[B, H, T, 2T - 1]` scores against distances `T - 1 .. -(T - 1)` -> `[B, H, T, T]` at `i - j`."""
    B, Hh, Tq, R = x.shape
    padded = torch.cat([x.new_zeros(B, Hh, Tq, 1), x], dim=-1).view(B, Hh, R + 1, Tq)
    return padded[:, :, 1:].reshape(B, Hh, Tq, R)[:, :, :, : R // 2 + 1]


class RelPosAttention(nn.Module):
    """The conformer's relative-position self-attention (linear q/k/v/out, linear_pos, pos_bias_u/v)."""

    def __init__(self):
        super().__init__()
        self.linear_q, self.linear_k, self.linear_v, self.linear_out = (nn.Linear(DIM, DIM) for _ in range(4))
        self.linear_pos = nn.Linear(DIM, DIM, bias=False)
        self.pos_bias_u = nn.Parameter(torch.randn(H, DK) * 0.5)
        self.pos_bias_v = nn.Parameter(torch.randn(H, DK) * 0.5)

    def heads(self, x, lin):  # [N, L, DIM] -> [N, H, L, DK]
        return lin(x).view(x.shape[0], -1, H, DK).transpose(1, 2)

    def full(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The whole utterance `[N, L, DIM]` with a `[L, L]` mask, as the model computes it offline."""
        L = x.shape[1]
        q, k, v = (self.heads(x, lin) for lin in (self.linear_q, self.linear_k, self.linear_v))
        p = self.linear_pos(espnet_pe(L, DIM)).view(1, -1, H, DK).transpose(1, 2)  # [1, H, 2L - 1, DK]
        ac = (q + self.pos_bias_u.view(1, H, 1, DK)) @ k.transpose(-1, -2)
        bd = rel_shift((q + self.pos_bias_v.view(1, H, 1, DK)) @ p.transpose(-1, -2))
        scores = ((ac + bd) / math.sqrt(DK)).masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return self.linear_out(out.transpose(1, 2).reshape(x.shape[0], L, DIM))

    def stream_step(self, cache, layer, x, plan, rel: RelativePosition):
        """One chunk `[N, T, DIM]` through `cache`: flexkv's form of the same attention."""
        q, k, v = (self.heads(x, lin) for lin in (self.linear_q, self.linear_k, self.linear_v))
        pos = self.linear_pos(encode_distance(rel.distances(), DIM).to(x)).view(rel.size, H, DK)
        term = rel.scores(q + self.pos_bias_v.view(1, H, 1, DK), pos, cache.stream_positions(plan))
        out = cache.attend(layer, q + self.pos_bias_u.view(1, H, 1, DK), k, v, plan, score_mod=term)
        return self.linear_out(out.transpose(1, 2).reshape(x.shape[0], -1, DIM))


def chunk_mask(L: int) -> torch.Tensor:
    """Query `i` of chunk `c` reads frames `c C - W .. c C + C + LA - 1`."""
    i = torch.arange(L).view(-1, 1)
    j = torch.arange(L).view(1, -1)
    start = (i // C) * C
    return (j >= start - W) & (j < start + C + LA)


CFG = BoundedKVConfig(num_layers=1, num_heads=H, head_dim=DK, rows_per_request=1, max_source_len=0, max_sources=0,
                      retention=SinkWindow(0, W), max_slots=3, max_step_tokens=T, dtype=torch.float32)
#: Utterances: (chunks, first step). The second joins late, so steps read gathered and in place.
UTTS = {"a": (7, 0), "b": (4, 2)}


def stream_and_compare(cache, step_fn, model, tolerance=None):
    """Stream every utterance chunk by chunk through `cache` with `step_fn(x, plan)`; largest difference
    from `model.full` over every written frame. With a `tolerance`, the first step and utterance
    further than it from `model.full` fails there."""
    g = torch.Generator().manual_seed(11)
    feats = {rid: torch.randn(1, n * C + LA, DIM, generator=g) for rid, (n, _) in UTTS.items()}
    want = {rid: model.full(x, chunk_mask(x.shape[1]))[0] for rid, x in feats.items()}
    done = {rid: 0 for rid in UTTS}
    worst, step_no, chunks = 0.0, 0, 0
    while any(done[r] < UTTS[r][0] * C for r in UTTS):
        live = [r for r in UTTS if UTTS[r][1] <= step_no and done[r] < UTTS[r][0] * C]
        segs = tuple(Segment(r, C) for r in live) + (Segment(None, 0),)
        step = BoundedKVStep(segs, {r: StreamPosition(0, done[r]) for r in live}, tokens=T)
        cache.admit(step)
        plan = cache.plan(step)
        x = torch.cat([feats[r][:, done[r]:done[r] + T] for r in live] + [torch.zeros(1, T, DIM)])
        out = step_fn(x, plan)
        cache.commit(step)
        for i, r in enumerate(live):
            got = out[i, :C]
            assert torch.isfinite(got).all(), got
            expected = want[r][done[r]:done[r] + C]
            if tolerance is not None:
                check_close(got, expected, tolerance,
                            f"step {step_no}, request {r!r} (frames {done[r]}..{done[r] + C - 1})")
            worst = max(worst, (got - expected).abs().max().item())
            done[r] += C
            chunks += 1
            if done[r] == UTTS[r][0] * C:
                cache.remove_request(r)
        step_no += 1
    assert chunks == sum(n for n, _ in UTTS.values())
    return worst


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(3)
    return RelPosAttention().eval().requires_grad_(False)


def test_distance_range_covers_what_the_retention_reaches():
    assert distance_range(CFG) == (-(T - 1), W + T - 1)
    assert distance_range(CFG, tokens=1) == (0, W)
    causal = CFG.replace(query_window=W, max_step_tokens=C)
    assert distance_range(causal) == (0, W)
    sinks = CFG.replace(retention=SinkWindow(2, W))
    with pytest.raises(ValueError, match="max_distance"):
        RelativePosition(sinks)
    assert RelativePosition(sinks, max_distance=40).hi == 40


def test_reference_is_not_blind_to_the_position_term(model):
    """Dropping the position term (or reading it at the wrong distance) moves the output by far more than TOL."""
    rel = RelativePosition(CFG)

    def step(x, plan, flip=False):
        if not flip:
            return model.stream_step(cache, 0, x, plan, rel)
        q, k, v = (model.heads(x, lin) for lin in (model.linear_q, model.linear_k, model.linear_v))
        pos = model.linear_pos(encode_distance(-rel.distances(), DIM)).view(rel.size, H, DK)  # j - i: wrong sign
        term = rel.scores(q + model.pos_bias_v.view(1, H, 1, DK), pos, cache.stream_positions(plan))
        out = cache.attend(0, q + model.pos_bias_u.view(1, H, 1, DK), k, v, plan, score_mod=term)
        return model.linear_out(out.transpose(1, 2).reshape(x.shape[0], -1, DIM))

    cache = BoundedKVManager(CFG)
    stream_and_compare(cache, step, model, tolerance=TOL)
    cache = BoundedKVManager(CFG)
    assert stream_and_compare(cache, lambda x, plan: step(x, plan, flip=True), model) > 1e-2


@pytest.mark.parametrize("path", ["rows", "flex"])
def test_eager_matches_the_model(model, path):
    cache = BoundedKVManager(CFG, block_size=8, options=AttentionOptions.for_cache(CFG, "cpu", path=path))
    rel = RelativePosition(CFG)
    stream_and_compare(cache, lambda x, plan: model.stream_step(cache, 0, x, plan, rel), model, tolerance=TOL)


def test_uncached_twin_matches_the_model(model):
    cache = UncachedHistory(CFG)
    rel = RelativePosition(CFG)
    stream_and_compare(cache, lambda x, plan: model.stream_step(cache, 0, x, plan, rel), model, tolerance=TOL)


@pytest.mark.parametrize("path", ["rows", "flex"])
def test_compiled_matches_the_model(model, path):
    """The table is computed inside the compiled step from the step's queries and read by the score_mod
    (FlexAttention's compiled CPU kernel, or the rows path's mask); one graph per batch shape."""
    from torch._dynamo.utils import counters

    cache = BoundedKVManager(CFG, options=AttentionOptions.for_cache(CFG, "cpu", path=path))
    rel = RelativePosition(CFG)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, plan: model.stream_step(cache, 0, x, plan, rel), fullgraph=True)
    before = counters["stats"]["unique_graphs"]
    stream_and_compare(cache, compiled, model, tolerance=TOL)
    assert counters["stats"]["unique_graphs"] - before <= 2  # one per batch shape (rows 2 and 3)


def test_reverse_step_order_reads_each_query_at_its_stream_position():
    """With chunks joining last-first the table's rows are put in stream order: the bounded cache agrees
    with the uncached twin, whose reference reads positions its own way."""
    cfg = CFG.replace(reverse_step_order=True)
    torch.manual_seed(4)
    model = RelPosAttention().eval().requires_grad_(False)
    outs = []
    for cache in (BoundedKVManager(cfg, block_size=8), UncachedHistory(cfg)):
        rel = RelativePosition(cfg)
        g = torch.Generator().manual_seed(5)
        got = []
        for n in range(4):
            step = BoundedKVStep((Segment("a", C),), {"a": StreamPosition(0, n * C)}, tokens=T)
            cache.admit(step)
            plan = cache.plan(step)
            got.append(model.stream_step(cache, 0, torch.randn(1, T, DIM, generator=g), plan, rel))
            cache.commit(step)
        outs.append(torch.cat(got, dim=1))
    assert (outs[0] - outs[1]).abs().max().item() < TOL


def test_bad_tables_are_refused():
    rel = RelativePosition(CFG)
    q = torch.zeros(2, H, T, DK)
    with pytest.raises(ValueError, match=r"pos must be \[R=%d" % rel.size):
        rel.scores(q, torch.zeros(rel.size - 1, H, DK), torch.zeros(2, T, dtype=torch.long))
    with pytest.raises(ValueError, match="stream_positions must be"):
        rel.scores(q, torch.zeros(rel.size, H, DK), torch.zeros(2, 1, dtype=torch.long))
    assert isinstance(rel.scores(q, torch.zeros(rel.size, H * DK), torch.zeros(2, T, dtype=torch.long)),
                      RelativePositionScores)
