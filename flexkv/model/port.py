"""Put flexkv under the attention of a model someone else wrote, keeping everything else of it.

A streaming model from elsewhere has attention modules that project
`q, k, v`, apply their own position encoding, attend over their own cache
and project back. `swap_attention` keeps the module, its projections, its
parameters and their `state_dict` keys, and replaces only its `forward` by
a function of yours that receives the module, the layer's flexkv attention
core and the module's original inputs::

    from flexkv import StreamSession
    from flexkv.model.port import swap_attention

    session = StreamSession(config)                      # the cache and the step loop

    def forward(self, attn, x):                          # self: the model's own attention module
        B, T, _ = x.shape
        q, k, v = self.in_proj(x).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k = self.rope(q, k, attn.stream_positions())  # its own RoPE, at flexkv's stream positions
        o = attn(q, k, v)                                # [B, heads, T, head_dim]: the cache's attention
        return self.out_proj(o.transpose(1, 2).reshape(B, T, -1))

    swap = swap_attention(model, session.context, MyAttention, forward)
    out = session.step({"a": chunk}, lambda attn, x: model(x))
    swap.restore()                                       # the model's own forward again

The modules are found in `model.modules()` order (by class, or by a
predicate on `(name, module)`), and the `i`-th one found is cache layer
`i`. Swapping works eager and under `torch.compile` (the swapped forward is
an instance attribute dynamo traces like any other function), and nothing
is registered on the model: its `state_dict`, `named_modules` and
parameters stay exactly as they were.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional, Sequence, Tuple, Union

from torch import nn

from .wrap import CacheAttention, StepContext

__all__ = ["swap_attention", "SwappedAttention"]

Match = Union[type, Tuple[type, ...], Callable[[str, nn.Module], bool]]

#: Modules whose forward is swapped now (weak: a dropped model is forgotten).
_SWAPPED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_NO_FORWARD = object()  # the module had no forward of its own (the class's was used)


def _matcher(match: Match) -> Callable[[str, nn.Module], bool]:
    if isinstance(match, type) or (isinstance(match, tuple) and match and all(isinstance(m, type) for m in match)):
        return lambda name, module: isinstance(module, match)
    if callable(match):
        return match
    raise ValueError(
        f"swap_attention: match must be an nn.Module class, a tuple of classes or a predicate "
        f"(name, module) -> bool, got {match!r}"
    )


class SwappedAttention:
    """What `swap_attention` returns: the swapped modules in layer order, and the way back.

    `modules[i]` (named `names[i]` in the model) is cache layer `i`, attending
    through `cores[i]`. `restore()` gives every module its own forward back;
    used as a context manager, the swap is undone on exit.
    """

    def __init__(self, names: Sequence[str], modules: Sequence[nn.Module], cores: Sequence[CacheAttention],
                 previous: Sequence[object]):
        self.names = tuple(names)
        self.modules = tuple(modules)
        self.cores = tuple(cores)
        self._previous = tuple(previous)
        self.active = True

    def layer_of(self, module: nn.Module) -> int:
        """The cache layer a swapped module attends through."""
        for i, m in enumerate(self.modules):
            if m is module:
                return i
        raise ValueError(f"{type(module).__name__} is not one of the swapped modules ({', '.join(self.names)})")

    def restore(self) -> None:
        """Give every swapped module its own forward back (a second call does nothing)."""
        if not self.active:
            return
        for module, previous in zip(self.modules, self._previous):
            if previous is _NO_FORWARD:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = previous
            _SWAPPED.discard(module)
        self.active = False

    def __enter__(self) -> "SwappedAttention":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def __len__(self) -> int:
        return len(self.modules)

    def __repr__(self):
        state = "active" if self.active else "restored"
        return f"SwappedAttention({len(self.modules)} layers: {', '.join(self.names)}; {state})"


def swap_attention(
    model: nn.Module,
    context: StepContext,
    match: Match,
    forward: Callable,
    *,
    core: Optional[Callable[[int, nn.Module], CacheAttention]] = None,
    **attention,
) -> SwappedAttention:
    """Swap the attention of `model`'s matching modules for flexkv's; returns a `SwappedAttention`.

    Args:
        model: the model (its modules, parameters and `state_dict` are left as they are).
        context: the `StepContext` the cores read the step from (`StreamSession.context`).
        match: the attention modules: an `nn.Module` class (or a tuple of
            classes), or a predicate `match(name, module) -> bool` over
            `model.named_modules()`. The `i`-th match, in `model.modules()`
            order, is cache layer `i`; there must be exactly
            `context.config.num_layers` of them.
        forward: the new forward, `forward(module, attn, *args, **kwargs)`:
            the model's own module, the layer's flexkv core `attn` (call it
            `attn(q, k, v)` with `q [N, Hq, T, D]`, `k [N, H, T, D]`,
            `v [N, H, T, Dv]` (`Dv = value_head_dim`), returning `[N, Hq, T, Dv]`;
            `attn.stream_positions()` gives each own token's stream index,
            `[N, T]`, on every cache) and whatever the module was called with.
        core: builds layer `i`'s core from `(i, module)` (per-layer options
            such as learned sinks); by default
            `CacheAttention(context, i, **attention)`.
        **attention: options of every layer's `CacheAttention` (`rotary`,
            `rope_positions`, `scale`, `score_mod`, `positions`, `sinks`).

    Raises `ValueError` (and swaps nothing) when no module or the wrong
    number matches, when a module is already swapped, or for a bad argument.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"swap_attention: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(context, StepContext):
        raise ValueError(
            f"swap_attention: context must be a flexkv.model.wrap.StepContext (StreamSession.context), "
            f"got {type(context).__name__}"
        )
    if not callable(forward):
        raise ValueError(f"swap_attention: forward must be a callable forward(module, attn, *args, **kwargs), "
                         f"got {forward!r}")
    if core is not None and attention:
        raise ValueError(f"swap_attention: give core or attention options ({', '.join(attention)}), not both")
    is_match = _matcher(match)
    found = [(name, m) for name, m in model.named_modules() if is_match(name, m)]
    layers = context.config.num_layers
    names = [name or "<the model itself>" for name, _ in found]
    if len(found) != layers:
        raise ValueError(
            f"swap_attention: {len(found)} modules match {match!r} ({', '.join(names) or 'none'}), but the cache "
            f"has num_layers={layers}; each attention module needs a cache layer of its own: build the cache "
            f"with num_layers={len(found)}, or match exactly the attention modules"
        )
    for name, m in zip(names, (m for _, m in found)):
        if m in _SWAPPED:
            raise ValueError(f"swap_attention: {name} is swapped already; restore() that swap first")
    cores = []
    for i, (_, m) in enumerate(found):
        c = core(i, m) if core is not None else CacheAttention(context, i, **attention)
        if not isinstance(c, CacheAttention) or c.layer_idx != i or c.context is not context:
            raise ValueError(
                f"swap_attention: core({i}, module) must return a CacheAttention of layer {i} on this context, "
                f"got {c!r}"
            )
        cores.append(c)
    modules = [m for _, m in found]
    previous = [m.__dict__.get("forward", _NO_FORWARD) for m in modules]
    swap = SwappedAttention(names, modules, cores, previous)
    for m, c in zip(modules, cores):
        m.__dict__["forward"] = _swapped_forward(forward, m, c)
        _SWAPPED.add(m)
    return swap


def _swapped_forward(forward: Callable, module: nn.Module, core: CacheAttention) -> Callable:
    def swapped(*args, **kwargs):
        return forward(module, core, *args, **kwargs)

    swapped.__name__ = f"flexkv_{getattr(forward, '__name__', 'forward')}"
    return swapped
