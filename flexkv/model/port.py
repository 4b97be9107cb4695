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
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from torch import nn

from ..config import is_int
from .attendance import explain_calls
from .step_context import StepContext
from .wrap import CacheAttention

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
    """What `swap_attention` returns: the swapped modules, the cache layers of their calls, and the way back.

    `modules[i]` (named `names[i]` in the model) attends, at its `c`-th call
    of a step, through cache layer `layers[i][c]`; `cores[l]` is layer `l`'s
    core. `restore()` gives every module its own methods back; used as a
    context manager, the swap is undone on exit.
    """

    def __init__(self, names: Sequence[str], modules: Sequence[nn.Module], cores: Sequence[CacheAttention],
                 previous: Sequence[Dict[str, object]], layers: Sequence[Tuple[int, ...]], methods: Sequence[str],
                 context: StepContext):
        self.names = tuple(names)
        self.modules = tuple(modules)
        self.cores = tuple(cores)
        self.layers = tuple(tuple(ls) for ls in layers)
        self.methods = tuple(methods)
        self._previous = tuple(previous)
        self._context = context
        #: calls of each module in the current step (zeroed in place when a step begins)
        self.calls: List[int] = [0] * len(self.modules)
        self.active = True

    # -- the attendance record's explainer: zeroes the call counts, says which call a layer is

    def start(self) -> None:
        self.calls[:] = [0] * len(self.modules)

    def explain(self, missing: List[int], twice: List[int]) -> List[str]:
        out = []
        for i, (name, layers, calls) in enumerate(zip(self.names, self.layers, self.calls)):
            msg = explain_calls(name, calls, len(layers), self.methods)
            if msg is not None:
                out.append(msg)
        return out

    def layer_of(self, module: nn.Module) -> int:
        """The cache layer a swapped module attends through (`layers_of` for a module called several
        times per step)."""
        layers = self.layers_of(module)
        if len(layers) != 1:
            raise ValueError(f"{self.names[self.modules.index(module)]} attends {len(layers)} cache layers, one per "
                             f"call of a step ({list(layers)}); use layers_of(module)")
        return layers[0]

    def layers_of(self, module: nn.Module) -> Tuple[int, ...]:
        """The cache layers of a swapped module's calls in a step: call `c` attends `layers_of(module)[c]`."""
        for m, layers in zip(self.modules, self.layers):
            if m is module:
                return layers
        raise ValueError(f"{type(module).__name__} is not one of the swapped modules ({', '.join(self.names)})")

    def restore(self) -> None:
        """Give every swapped module its own methods back (a second call does nothing)."""
        if not self.active:
            return
        for module, previous in zip(self.modules, self._previous):
            for method, prev in previous.items():
                if prev is _NO_FORWARD:
                    module.__dict__.pop(method, None)
                else:
                    module.__dict__[method] = prev
            _SWAPPED.discard(module)
        self._context.attendance.remove_explainer(self)
        self.active = False

    def __enter__(self) -> "SwappedAttention":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def __len__(self) -> int:
        return len(self.modules)

    def __repr__(self):
        state = "active" if self.active else "restored"
        return f"SwappedAttention({len(self.cores)} layers: {', '.join(self.names)}; {state})"


def _methods(forward, methods) -> Dict[str, Callable]:
    """`{method name: replacement}` from `forward` (one callable, or a mapping name -> callable) and `methods`."""
    if isinstance(forward, Mapping):
        table = dict(forward)
        if methods is not None and tuple(methods) != tuple(table):
            raise ValueError(f"swap_attention: forward is a mapping of methods ({', '.join(table)}); leave methods "
                             f"out (it would say {tuple(methods)!r})")
    else:
        names = ("forward",) if methods is None else ((methods,) if isinstance(methods, str) else tuple(methods))
        table = {name: forward for name in names}
    if not table:
        raise ValueError("swap_attention: methods is empty; name the method(s) the model calls, e.g. ('forward',)")
    for name, fn in table.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"swap_attention: a method name must be an identifier str, got {name!r}")
        if not callable(fn):
            raise ValueError(f"swap_attention: the replacement of {name} must be a callable "
                             f"forward(module, attn, *args, **kwargs), got {fn!r}")
    return table


def _call_layers(counts: Sequence[int]) -> List[Tuple[int, ...]]:
    """Cache layers of every module's calls, call-major: first call of every module (in match order),
    then every second call, and so on (a loop over the blocks, run again)."""
    layers: List[List[int]] = [[] for _ in counts]
    nxt = 0
    for c in range(max(counts, default=0)):
        for i, n in enumerate(counts):
            if c < n:
                layers[i].append(nxt)
                nxt += 1
    return [tuple(ls) for ls in layers]


def swap_attention(
    model: nn.Module,
    context: StepContext,
    match: Match,
    forward: Union[Callable, Mapping[str, Callable]],
    *,
    methods: Union[None, str, Sequence[str]] = None,
    calls_per_step: Union[int, Sequence[int]] = 1,
    core: Optional[Callable[[int, nn.Module], CacheAttention]] = None,
    **attention,
) -> SwappedAttention:
    """Swap the attention of `model`'s matching modules for flexkv's; returns a `SwappedAttention`.

    Args:
        model: the model (its modules, parameters and `state_dict` are left as they are).
        context: the `StepContext` the cores read the step from (`StreamSession.context`).
        match: the attention modules: an `nn.Module` class (or a tuple of
            classes), or a predicate `match(name, module) -> bool` over
            `model.named_modules()`, found in `model.modules()` order.
        forward: the replacement, `forward(module, attn, *args, **kwargs)`:
            the model's own module, the flexkv core `attn` of the call's
            cache layer (call it `attn(q, k, v)` with `q [N, Hq, T, D]`,
            `k [N, H, T, D]`,
            `v [N, H, T, Dv]` (`Dv = value_head_dim`), returning `[N, Hq, T, Dv]`; `attn.stream_positions()` gives each own
            token's stream index, `[N, T]`, on every cache) and whatever the
            method was called with. A mapping `{method: replacement}` gives
            each method its own.
        methods: the method name(s) replaced, default ``("forward",)``: name
            every method through which the model attends (a block that calls
            `self.attn.forward_chunk(...)` needs ``methods=("forward_chunk",)``).
        calls_per_step: how many times the model calls each module in one
            step (an int for every module, or one per module in match
            order): a module run once per solver step, or a weight-tied layer
            looped `k` times, attends a cache layer of its own at each call.
            Layers go call-major: the first call of every module (in match
            order), then every second call, and so on; there must be exactly
            `context.config.num_layers` of them (`sum(calls_per_step)`).
        core: builds layer `l`'s core from `(l, module)` (per-layer options
            such as learned sinks); by default
            `CacheAttention(context, l, **attention)`.
        **attention: options of every layer's `CacheAttention` (`rotary`,
            `rope_positions`, `scale`, `score_mod`, `positions`, `sinks`).

    A step whose calls do not match the declaration (a method the model never
    calls, a module called more or fewer times) is refused when it commits,
    naming the module, its calls and the methods swapped; nothing is
    committed. Raises `ValueError` (and swaps nothing) when no module or the
    wrong number matches, when a module is already swapped or lacks a named
    method, or for a bad argument.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"swap_attention: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(context, StepContext):
        raise ValueError(
            f"swap_attention: context must be a flexkv.model.step_context.StepContext (StreamSession.context), "
            f"got {type(context).__name__}"
        )
    if not callable(forward) and not isinstance(forward, Mapping):
        raise ValueError(f"swap_attention: forward must be a callable forward(module, attn, *args, **kwargs) "
                         f"(or a mapping method name -> such a callable), got {forward!r}")
    table = _methods(forward, methods)
    if core is not None and attention:
        raise ValueError(f"swap_attention: give core or attention options ({', '.join(attention)}), not both")
    is_match = _matcher(match)
    found = [(name, m) for name, m in model.named_modules() if is_match(name, m)]
    names = [name or "<the model itself>" for name, _ in found]
    if is_int(calls_per_step):
        counts = [calls_per_step] * len(found)
        per = f"calls_per_step={calls_per_step}"
    else:
        try:
            counts = list(calls_per_step)
        except TypeError:
            raise ValueError(f"swap_attention: calls_per_step must be an int >= 1 or one per matched module, "
                             f"got {calls_per_step!r}") from None
        per = f"calls_per_step={counts}"
        if len(counts) != len(found):
            raise ValueError(
                f"swap_attention: calls_per_step gives {len(counts)} counts, but {len(found)} modules match "
                f"{match!r} ({', '.join(names) or 'none'}); give one count per module, in match order"
            )
    if any(not is_int(n) or n < 1 for n in counts):
        raise ValueError(f"swap_attention: calls_per_step must be ints >= 1 (calls of a module in one step), "
                         f"got {calls_per_step!r}")
    layers = context.config.num_layers
    total = sum(counts)
    if not found or total != layers:
        hint = ""
        if found and is_int(calls_per_step) and layers % len(found) == 0 and layers // len(found) != calls_per_step:
            hint = (f", or, if the model calls each of them {layers // len(found)} times in a step (solver steps, "
                    f"looped or weight-tied layers), pass calls_per_step={layers // len(found)}")
        raise ValueError(
            f"swap_attention: {len(found)} modules match {match!r} ({', '.join(names) or 'none'}); with {per} "
            f"that is {total} attention calls per step, but the cache has num_layers={layers}; each "
            f"attention call of a step needs a cache layer of its own: build the cache with num_layers={total}"
            f"{hint}, or match exactly the attention modules"
        )
    for name, m in zip(names, (m for _, m in found)):
        if m in _SWAPPED:
            raise ValueError(f"swap_attention: {name} is swapped already; restore() that swap first")
        for method in table:
            if not callable(getattr(m, method, None)):
                raise ValueError(
                    f"swap_attention: {name} ({type(m).__name__}) has no method {method!r} to replace; name the "
                    f"method(s) through which the model attends (methods=...)"
                )
    call_layers = _call_layers(counts)
    modules = [m for _, m in found]
    cores: List[Optional[CacheAttention]] = [None] * layers
    for m, ls in zip(modules, call_layers):
        for l in ls:
            c = core(l, m) if core is not None else CacheAttention(context, l, **attention)
            if not isinstance(c, CacheAttention) or c.layer_idx != l or c.context is not context:
                raise ValueError(
                    f"swap_attention: core({l}, module) must return a CacheAttention of layer {l} on this context, "
                    f"got {c!r}"
                )
            cores[l] = c
    previous = [{method: m.__dict__.get(method, _NO_FORWARD) for method in table} for m in modules]
    swap = SwappedAttention(names, modules, cores, previous, call_layers, tuple(table), context)
    for i, (m, ls) in enumerate(zip(modules, call_layers)):
        module_cores = tuple(cores[l] for l in ls)
        for method, fn in table.items():
            m.__dict__[method] = _swapped_method(fn, method, m, module_cores, swap, i)
        _SWAPPED.add(m)
    context.attendance.add_explainer(swap)
    return swap


def _swapped_method(forward: Callable, method: str, module: nn.Module, cores: Tuple[CacheAttention, ...],
                    swap: SwappedAttention, index: int) -> Callable:
    # The swapped methods hold the swap (the context's attendance record holds it weakly): it lives as
    # long as the model, and zeroes its call counts at every step.
    last = len(cores) - 1

    def swapped(*args, **kwargs):
        # The c-th call of the module in this step attends its c-th layer. A call past the declared count
        # attends the last one again: the step's attendance check then refuses it, naming the calls.
        calls = swap.calls
        c = calls[index]
        calls[index] = c + 1
        return forward(module, cores[min(c, last)], *args, **kwargs)

    swapped.__name__ = f"flexkv_{getattr(forward, '__name__', method)}"
    return swapped
