"""The attention-only model the session tests step, and its feeds.

A request's feed is `[T, 3, H, D]`: q, k and v per token. `model` turns a
batch of feeds into every layer's attention output, so each output can be
compared with `ReferenceCache.attend` on the step the session ran.
"""

import torch

H, D, LAYERS = 2, 8, 2


def model(attn, x):
    """`x [B, T, 3, H, D]` (q, k, v per token) -> `[B, T, LAYERS, H, D]`: each layer's attention output.

    Layer `l` attends `x` scaled by `l + 1`, so the layers hold different keys.
    """
    outs = []
    for layer in range(LAYERS):
        q, k, v = ((x[:, :, i] * (layer + 1)).transpose(1, 2) for i in range(3))
        outs.append(attn(layer, q, k, v).transpose(1, 2))
    return torch.stack(outs, dim=2)


def feed(n, seed):
    """`n` tokens of one request's feed, `[n, 3, H, D]`, from `seed`."""
    return torch.randn(n, 3, H, D, generator=torch.Generator().manual_seed(seed))


def worst_difference(ref, res, feeds, outputs=None) -> float:
    """Attend `res.step` (a session step that ran `model`) through the dense reference `ref` and
    return the largest difference from what the session returned for each request; commits the
    step to `ref`. `outputs(res, rid)` picks a request's attention output (default `res[rid]`)."""
    from flexkv import Chunk

    B, T = len(res.step.segments), res.step.step_tokens
    x = torch.zeros(B, T, 3, H, D)
    for rid, lane in res.lanes.items():
        data = feeds[rid].inputs if isinstance(feeds[rid], Chunk) else feeds[rid]
        x[lane, :len(data)] = data
    worst = 0.0
    for layer in range(LAYERS):
        q, k, v = ((x[:, :, i] * (layer + 1)).transpose(1, 2) for i in range(3))
        want = ref.attend(layer, q, k, v, res.step).transpose(1, 2)
        for rid, lane in res.lanes.items():
            got = (res[rid] if outputs is None else outputs(res, rid))[:, layer]
            worst = max(worst, (got.double() - want[lane, :res.tokens[rid]]).abs().max().item())
    ref.commit(res.step)
    return worst
