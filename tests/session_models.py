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


#: The largest difference from the float64 reference a float32 session step may show.
TOLERANCE = 1e-5


def check_step(ref, res, feeds, outputs=None, where: str = "", tolerance: float = TOLERANCE) -> float:
    """Attend `res.step` (a session step that ran `model`) through the dense reference `ref`, compare
    each layer of each request's output with it and commit the step to `ref`. The first layer and
    request further than `tolerance` from the reference fails there, named after `where` (the
    caller's step). Returns the largest difference. `outputs(res, rid)` picks a request's attention
    output (default `res[rid]`)."""
    from random_workload import check_close

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
            worst = max(worst, check_close(got, want[lane, :res.tokens[rid]], tolerance,
                                           f"{where + ', ' if where else ''}layer {layer}, request {rid!r} "
                                           f"(lane {lane})"))
    ref.commit(res.step)
    return worst
