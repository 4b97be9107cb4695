"""Learned attention sinks (`flexkv.cache.paths.sinks`): one extra softmax score per query head, with a zero value."""

import torch

from flexkv.cache.paths.sinks import apply_learned_sinks

HQ, D = 4, 8


def test_learned_sinks_rescale_by_the_extra_softmax_term():
    g = torch.Generator().manual_seed(3)
    N, T, K = 2, 3, 5
    scores = torch.randn(N, HQ, T, K, generator=g, dtype=torch.float64) * 3
    values = torch.randn(N, HQ, K, D, generator=g, dtype=torch.float64)
    sinks = torch.randn(HQ, generator=g, dtype=torch.float32)
    out = torch.softmax(scores, -1) @ values
    lse = torch.logsumexp(scores, -1)
    got = apply_learned_sinks(out, lse, sinks)
    extra = sinks.double().view(1, HQ, 1, 1).expand(N, HQ, T, 1)
    want = torch.softmax(torch.cat([scores, extra], -1), -1)[..., :K] @ values
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


def test_a_query_that_attends_nothing_keeps_its_zeros():
    dead = apply_learned_sinks(torch.zeros(1, HQ, 1, D), torch.full((1, HQ, 1), float("-inf")),
                               torch.full((HQ,), float("-inf")))
    assert torch.equal(dead, torch.zeros_like(dead))
