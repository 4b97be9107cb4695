"""`StepContext`: the one owner of a model step over flexkv caches.

Every core reads the step from a `StepContext`, the one object a model's
layers share: the host loop calls `context.begin(step)` (admit, checks,
plan), runs the model, then `context.commit()`, or `context.abort()` if the
model raised (`with context.stepping(step) as plan:` does both). The step is
one `flexkv.cache.host.transaction.StepTransaction`: an aborted step changes
nothing in the cache. Every front door steps through a context (a
`StreamSession`, a port's `swap_attention`, `flexkv run`, the transformers
`FlexKVCache`), and the context is the only caller of a cache's `attend`: it
counts each layer's calls for the step's attendance check
(`flexkv.model.attendance`). Nothing about the step is an argument of the
layers, so the model's own forward signature stays as it was.
`context.stream_positions()` gives the step's stream index of every own token
(for a model that applies its own position encoding).

Compiled use: compile a function that takes the plan as an argument and
binds it before running the model::

    context = StepContext(manager)
    model = MyModel(attention=lambda i: CacheAttention(context, i))

    def forward(plan, x):
        context.bind(plan)  # inside the graph: the plan is an input, not a guard
        return model(x)

    step_fn = torch.compile(forward, fullgraph=True, dynamic=False)
    plan = context.begin(step)   # host: admit, check, plan (never waits on the device)
    y = step_fn(plan, x)
    context.commit()

Passing the plan as an argument makes it a graph input explicitly.

A model that keeps several caches (two attention stacks at different
frame rates) steps them with one context over named caches,
`StepContext({"slow": cache_25, "fast": cache_50})`, which builds a
`MultiStepContext`: its `begin`, `bind` and `stepping` take mappings of name
-> step or plan, and its `context[name]` is the one-cache context that
cache's layers are built on (`flexkv.model.multi_context` says what a step
over several caches guarantees). Each shape is a class of its own, chosen
once when the context is built; a one-cache context is the one-entry case
inside (`contexts` is `{None: self}`), unwrapped at its surface. A forward of a long
prompt is one step in chunks (`begin` takes the chunk steps; each layer
attends once per chunk), and a model whose layers share keys maps its layers
onto the cache's (`StepContext(cache, layers=...)`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Hashable, Iterator, List, Mapping, Optional, Sequence

import torch

from ..cache.host.transaction import StepTransaction
from ..cache.protocol import check_cache
from ..config import check_layer_index, is_int
from ..step import BoundedKVStep
from .attendance import AttendanceRecord, layer_ranges

__all__ = ["StepContext", "named_error", "naming_errors", "layer_map", "chunks_of"]


def named_error(exc: BaseException, name: Hashable, where: str) -> BaseException:
    """`exc` again, of its own type, with `where` and the cache `name` in front of its message (the
    original when its type cannot be rebuilt from one message, or it is not an `Exception`)."""
    if not isinstance(exc, Exception):
        return exc
    try:
        named = type(exc)(f"{where}: cache {name!r}: {exc}")
    except Exception:
        return exc
    named.__cause__ = exc
    return named


@contextlib.contextmanager
def naming_errors(name: Hashable, where: str):
    """An `Exception` raised inside, by cache `name`, raised again by `named_error`."""
    try:
        yield
    except Exception as exc:
        raise named_error(exc, name, where) from None


def layer_map(layers, num_layers: int, where: str) -> tuple:
    """`layers` checked as a map of model layer -> the cache layer it attends (an int in `range(num_layers)`)
    or None (the layer attends none): several model layers may attend one cache layer (layers that share
    another layer's keys and values), and every cache layer is attended by some model layer."""
    try:
        out = tuple(layers)
    except TypeError:
        raise ValueError(f"{where}: layers must be a sequence of cache layer indices (or None), one per model "
                         f"layer, got {layers!r}") from None
    for i, kv in enumerate(out):
        if kv is not None and not (is_int(kv) and 0 <= kv < num_layers):
            raise ValueError(f"{where}: layers[{i}]={kv!r} is no cache layer; the cache has layers 0..{num_layers - 1} "
                             f"(None: model layer {i} attends none)")
    unread = sorted(set(range(num_layers)) - {kv for kv in out if kv is not None})
    if unread:
        raise ValueError(f"{where}: no model layer attends cache layers {layer_ranges(unread)}; a cache layer no "
                         f"layer attends would never be written (build the cache with the layers the model attends)")
    return out


def chunks_of(steps, where: str) -> tuple:
    """A step given in chunks, checked: a non-empty sequence of `BoundedKVStep`s."""
    out = tuple(steps)
    if not out or not all(isinstance(s, BoundedKVStep) for s in out):
        raise ValueError(f"{where}: a step in chunks is a non-empty sequence of BoundedKVSteps, got {steps!r}")
    return out


class StepContext:
    """The caches a model's attention layers share, and the step they are running.

    `StepContext(cache)`: one cache (any `flexkv.cache.protocol.StreamCache`).
    `StepContext(cache, layers=...)`: a model whose layers do not map one to one onto the cache's:
    `layers[i]` is the cache layer model layer `i` attends (None: it attends none, a recurrent layer),
    several model layers may read one cache layer (layers sharing another's keys and values); `attend`
    takes model layers and the attendance check counts them.
    `begin(step) -> plan`, the model's forward, then `commit()` (or `abort()`
    when it raised); `stepping(step)` is both as a `with` block. In a compiled
    step, call `bind(plan)` inside the compiled function. `plan` is the plan
    the layers read: the one place a cache's current plan lives (caches keep
    none; every `attend` is given it).

    `StepContext({name: cache, ...})`: several named caches stepped as one, a `MultiStepContext`
    (`flexkv.model.multi_context` says what that guarantees). Then `begin`,
    `bind` and `stepping` take and return mappings of name -> step or plan,
    and `context[name]` is the one-cache context of that cache, what the layers
    of that cache are built on (`attention(context[name], layer)`) and call
    (`context[name](layer, q, k, v)`); it shares that cache's plan and attendance
    record with this context. A mapping value may be such a one-cache context
    already. A one-cache context is the one-entry case: `context[None]` is
    itself.

    Either way a step is one `flexkv.cache.host.transaction.StepTransaction` over
    every cache, with one commit check: every declared layer of every cache
    attended exactly once (`flexkv.model.attendance`).
    """

    #: The class of a context over named caches (`flexkv.model.multi_context.MultiStepContext`, which names
    #: itself so when it is defined: `flexkv.model` imports it).
    _named_shape: Optional[type] = None

    def __init_subclass__(cls, named_shape: bool = False, **kwargs):
        super().__init_subclass__(**kwargs)
        if named_shape:
            StepContext._named_shape = cls

    def __new__(cls, caches=None, *args, **kwargs):
        # `StepContext({name: cache, ...})` is the context over named caches: one class per shape, chosen here
        # once, so no method asks which shape it serves.
        if cls is StepContext and isinstance(caches, Mapping):
            return super().__new__(StepContext._named_shape)
        return super().__new__(cls)

    def __init__(self, caches, *, layers: Optional[Sequence[Optional[int]]] = None):
        kind = type(self).__name__
        self._init_step_state(kind)
        self.cache = check_cache(caches, kind)
        if layers is None:
            #: attend calls per cache layer in the current step; the commit check refuses a step that did
            #: not attend every layer exactly once (`flexkv.model.attendance`)
            self.attendance: Optional[AttendanceRecord] = AttendanceRecord(self.cache.config.num_layers)
        else:
            self._layers = layer_map(layers, self.cache.config.num_layers, kind)
            self._attending = tuple(i for i, c in enumerate(self._layers) if c is not None)
            self.attendance = AttendanceRecord(len(self._layers), "attention layer")
        #: name -> one-cache context; a one-cache context is its own one entry
        self.contexts: Dict[Hashable, StepContext] = {None: self}

    def _init_step_state(self, kind: str) -> None:
        """What every context keeps of the step, before its caches are set."""
        #: The step begun last (`flexkv.cache.host.transaction.StepTransaction`), None before the first.
        self.transaction: Optional[StepTransaction] = None
        #: The plan the layers read (a one-cache context; None on a named one, whose plans live in `context[name]`,
        #: and outside a step).
        self.plan: Any = None
        #: The step begun last (a one-cache context).
        self.step: Optional[BoundedKVStep] = None
        self._where = f"{kind}.commit"  # who commits, named in an attendance error
        self._checks: List[Callable[[BoundedKVStep], None]] = []
        #: model layer -> the cache layer it attends (None: the identity), and the model layers that attend one
        self._layers: Optional[tuple] = None
        self._attending: Optional[tuple] = None

    # ------------------------------------------------------------- the caches

    def __getitem__(self, name) -> "StepContext":
        try:
            return self.contexts[name]
        except (KeyError, TypeError):
            raise KeyError(f"no cache named {name!r}; this step's caches are {list(self.contexts)}") from None

    def __iter__(self) -> Iterator:
        return iter(self.contexts)

    def __len__(self) -> int:
        return len(self.contexts)

    def __contains__(self, name) -> bool:
        try:
            return name in self.contexts
        except TypeError:
            return False

    def keys(self):
        return self.contexts.keys()

    def values(self):
        return self.contexts.values()

    def items(self):
        return self.contexts.items()

    @property
    def caches(self) -> Dict[Hashable, Any]:
        """name -> cache (a one-cache context: `{None: cache}`)."""
        return {name: ctx.cache for name, ctx in self.contexts.items()}

    @property
    def plans(self) -> Optional[Dict[Hashable, Any]]:
        """name -> the plan each cache's layers read (None outside a step: before `begin`, after `commit`
        or `abort`)."""
        if self.transaction is None or not self.transaction.is_open:
            return None
        return {name: ctx.plan for name, ctx in self.contexts.items()}

    def _the_cache(self, what: str) -> None:
        """Refuse `what` on a context over several caches (it belongs to one of them); a one-cache context
        serves it."""

    @property
    def config(self):
        self._the_cache("config")
        return self.cache.config

    # ------------------------------------------------------------- the step

    def add_check(self, check: Callable[[BoundedKVStep], None]) -> None:
        """Run `check(step)` in every `begin` (host-side validation a layer needs)."""
        self._the_cache("add_check")
        if check not in self._checks:
            self._checks.append(check)

    def check_steps(self, steps: Mapping[Hashable, BoundedKVStep], where: Optional[str] = None) -> None:
        """Raise unless `steps` gives exactly one `BoundedKVStep` per named cache."""
        where = where or f"{type(self).__name__}.begin"
        if not isinstance(steps, Mapping):
            raise ValueError(f"{where}: steps must be a mapping of cache name -> BoundedKVStep, got {steps!r}")
        unknown = [n for n in steps if n not in self.contexts]
        missing = [n for n in self.contexts if n not in steps]
        if unknown or missing:
            raise ValueError(
                f"{where}: give one step per cache, named {list(self.contexts)}; "
                + (f"no cache is named {unknown}" if unknown else "")
                + ("; " if unknown and missing else "")
                + (f"no step for {missing} (a cache that no request feeds this step takes a step of padding "
                   f"segments: its layers are still attended, once each)" if missing else "")
            )
        for name, step in steps.items():
            if not isinstance(step, BoundedKVStep):
                raise ValueError(f"{where}: the step of cache {name!r} must be a BoundedKVStep, got {step!r}")

    def begin(self, step, transaction: Optional[StepTransaction] = None, *, eager_only: bool = False):
        """Check, admit and plan the step; returns its plan (name -> plan over named caches).

        `step` is a `BoundedKVStep` (one cache) or name -> `BoundedKVStep`, one per cache (a cache no
        request feeds takes a step of padding segments). A one-cache context also takes a step in
        chunks, a sequence of `BoundedKVStep`s over the same streams, each planned at the positions
        the chunks before leave (one forward of a long prompt): the first admits, the step's plan is
        then the tuple of the chunks' plans, every layer attends once per chunk (`attend(...,
        plan=plans[i])`), and `commit` commits the chunks in order. Each cache's layer checks run first, then
        its admission and plan, cache by cache; if any cache refuses, no cache keeps anything of
        the step (and over named caches the error names the cache). The step runs in `transaction`
        (a door that admitted more in it first, such as a session starting requests) or a new one.
        Refused while the step begun last is still open: `commit()` or `abort()` it first.
        `eager_only=True`: the step's layers run eagerly, and its plans are made for eager calls only
        (what a compiled step reads ahead of its graph is left out, `StreamLifecycle.plan`): cheaper,
        and a step run compiled needs plans made without it.
        """
        where = f"{type(self).__name__}.begin"
        if any(c.transaction is not None and c.transaction.is_open for c in (self, *self.contexts.values())):
            raise ValueError(f"{where}: the step begun last is still open; commit() it after its forward, or "
                             f"abort() it if the forward failed")
        steps = self._named_steps(step, where)
        txn = StepTransaction(next(iter(self.contexts.values())).cache) if transaction is None else transaction
        plans: Dict[Hashable, Any] = {}
        name = None
        try:
            for name, ctx in self.contexts.items():
                chunks = steps[name] if isinstance(steps[name], tuple) else (steps[name],)
                for check in ctx._checks:  # before the admission, so a refused step admits nothing here
                    for chunk in chunks:
                        check(chunk)
                first = txn.begin(chunks[0], ctx.cache, eager_only=eager_only)
                if chunks is steps[name]:  # the later chunks continue the streams the first admitted
                    plans[name] = (first, *(txn.plan(c, ctx.cache, eager_only=eager_only) for c in chunks[1:]))
                else:
                    plans[name] = first
        except BaseException as exc:
            txn.abort()
            self._refused(exc, name, where)
            raise
        for name, ctx in self.contexts.items():
            ctx.transaction, ctx.step, ctx.plan = txn, steps[name], plans[name]
            ctx.attendance.start(len(plans[name]) if isinstance(plans[name], tuple) else 1)
        self.transaction, self._where = txn, f"{type(self).__name__}.commit"
        # The step's one attendance check, before anything commits: every declared layer of every cache once.
        txn.add_commit_check(lambda _txn: self.check_attendance(self._where))
        return self._surface(plans)

    # The shape's own part of `begin` (a context over named caches overrides them).
    def _named_steps(self, step, where: str) -> dict:
        """The step as name -> step: a one-cache context's one step (or its chunks), named None."""
        return {None: chunks_of(step, where) if isinstance(step, (tuple, list)) else step}

    def _refused(self, exc: BaseException, name, where: str) -> None:
        """An error a cache raised in `begin` (the step already taken back): raise it as the caller should see
        it, or return to raise it as it is (one cache: as it is)."""

    def _surface(self, per_cache: dict):
        """A name -> value mapping as this context's caller takes it: a one-cache context's one value."""
        return per_cache[None]

    def bind(self, plan) -> None:
        """Make `plan` the one the layers read (name -> plan over named caches); call it inside a
        compiled step, on its argument."""
        self.plan = plan

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, plan: Any = None,
               **kwargs) -> torch.Tensor:
        """Attention of layer `layer_idx` for the bound step, counted for the step's attendance check:
        the cache's `attend(layer_idx, q, k, v, plan, **kwargs)` (with `layers=`, of the cache layer model
        layer `layer_idx` attends). Calling the context does the same: `context(layer_idx, q, k, v)` (over
        named caches, `context[name](layer_idx, q, k, v)`). `plan`: the bound plan by default; a step
        begun in chunks passes each chunk's (`plans[i]`), once per chunk. `attend_lse`,
        `attend_query_only` and `attend_joined` are the cache's other modes (`flexkv.cache.attend_modes`),
        taken alike."""
        bound = self.plan if plan is None else plan
        if bound is None or bound.__class__ is tuple:
            bound = self._plan_for("attend", plan)  # raises what is wrong: no step, chunks
        self.attendance.attended(layer_idx)
        return self.cache.attend(layer_idx if self._layers is None else self._cache_layer(layer_idx), q, k, v, bound,
                                 **kwargs)

    def _mode(self, what: str, layer_idx: int, plan: Any):
        """`(the cache's method what, its layer, the plan)` for a call of `what`, counted as the layer's."""
        bound = self._plan_for(what, plan)
        layer = self._cache_layer(layer_idx)
        self.attendance.attended(layer_idx)
        return getattr(self.cache, what), layer, bound

    def attend_lse(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, plan: Any = None,
                   **kwargs):
        """The cache's `attend_lse` (an `Attended`), as `attend`."""
        fn, layer, bound = self._mode("attend_lse", layer_idx, plan)
        return fn(layer, q, k, v, bound, **kwargs)

    def attend_query_only(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          query_only: torch.Tensor, *, plan: Any = None, **kwargs):
        """The cache's `attend_query_only` (an `Attended` over the step's and the query-only queries), as
        `attend`."""
        fn, layer, bound = self._mode("attend_query_only", layer_idx, plan)
        return fn(layer, q, k, v, bound, query_only, **kwargs)

    def attend_joined(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, parts, *,
                      plan: Any = None, **kwargs):
        """The cache's `attend_joined` (an `Attended`), as `attend`."""
        fn, layer, bound = self._mode("attend_joined", layer_idx, plan)
        return fn(layer, q, k, v, bound, parts, **kwargs)

    __call__ = attend

    def write_part(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """The bound step's keys written into layer `layer_idx`, and the cells each row's newest own token
        reads, as a `flexkv.cache.paths.joint_path.KeyPart` that another cache's `attend_joined`
        reads in its softmax: the cache's `write_part(layer_idx, k, v, plan)`, counted for the step's
        attendance check as the layer's attention."""
        plan = self._plan_for("write_part", None)
        if not hasattr(self.cache, "write_part"):
            raise ValueError(f"{type(self).__name__}.write_part: a {type(self.cache).__name__} has no write_part "
                             f"(a BoundedKVManager does); attend the layer through attend() instead")
        self.attendance.attended(layer_idx)
        return self.cache.write_part(self._cache_layer(layer_idx), k, v, plan)

    def _plan_for(self, what: str, plan: Any) -> Any:
        """The plan a call of `what` reads: `plan` when given, else the bound one (a single step's); raises
        on a context over several caches (the call belongs to one of them) and where no plan is bound."""
        self._the_cache(what)
        if plan is not None:
            return plan
        if self.plan is None:
            raise ValueError(f"{type(self).__name__}.{what}: no step; call begin(step) (and bind(plan) when "
                             f"compiled) first")
        if isinstance(self.plan, tuple):
            raise ValueError(f"{type(self).__name__}.{what}: the step was begun in {len(self.plan)} chunks; pass "
                             f"each chunk's plan, {what}(..., plan=plans[i])")
        return self.plan

    def _cache_layer(self, layer_idx: int) -> int:
        """The cache layer model layer `layer_idx` attends (itself without `layers=`)."""
        if self._layers is None:
            return layer_idx
        kv = self._layers[check_layer_index(layer_idx, len(self._layers))]
        if kv is None:
            raise ValueError(f"{type(self).__name__}: model layer {layer_idx} attends no cache layer (layers= maps it "
                             f"to None); only layers {layer_ranges(self._attending)} attend")
        return kv

    def stream_positions(self, tokens: Optional[int] = None) -> torch.Tensor:
        """Stream index of each own token of the bound step, `[N, T]` int64 (contract section 2).

        The same for every cache (the uncached twin included): what a model
        that rotates its own queries and keys (or adds its own position
        encoding) needs. On the device and traceable for a bounded cache.
        Padding rows count from 0.
        """
        return self.cache.stream_positions(self._plan_for("stream_positions", None), tokens)

    def stream_offsets(self) -> torch.Tensor:
        """Stream index of each row's first own token of the bound step, `[N]` int64: the row offset a
        position encoding that adds `arange(T)` itself takes (`stream_positions()` is
        `stream_offsets()[:, None] + arange(T)`). Refused with `reverse_step_order`, whose positions
        count down inside a step."""
        plan = self._plan_for("stream_offsets", None)
        if self.config.reverse_step_order:
            raise ValueError(
                "stream_offsets(): with reverse_step_order=True a step's tokens sit at n + span - 1 - t (they "
                "count down), which no row offset + arange(T) gives; use stream_positions() [N, T]"
            )
        return self.cache.stream_positions(plan, 1)[:, 0]

    def check_attendance(self, where: Optional[str] = None) -> None:
        """Raise `flexkv.model.attendance.AttendanceError` unless the bound step attended every declared
        layer of every cache exactly once (the first cache that fails is named, over named caches).
        The step's commit check; `where` says who commits (default `<class>.commit`)."""
        self.attendance.check(where or f"{type(self).__name__}.commit", self._attending)

    def commit(self, where: Optional[str] = None) -> None:
        """Commit the step begun last in every cache: its transaction's commit checks first (the
        attendance check among them), then every cache's commit. A check that fails commits nothing
        in any cache and aborts the step. `where` names who commits in an attendance error (a
        session's step says so)."""
        if self.transaction is None:
            raise ValueError(f"{type(self).__name__}.commit: no step was begun; call begin(step) first")
        if where is not None:
            self._where = where
        try:
            self.transaction.commit()
        finally:
            if not self.transaction.is_open:
                self._end()

    def abort(self) -> bool:
        """Take back the step begun last in every cache: each is as it was before `begin`. Returns
        False when no step is open (nothing to undo)."""
        if self.transaction is None:
            return False
        try:
            return self.transaction.abort()
        finally:
            self._end()

    def _end(self) -> None:
        """The step is over (committed or taken back): no layer may attend with its plans, and a context that
        lives on between steps keeps none of their tables."""
        for ctx in (self, *self.contexts.values()):
            ctx.plan = ctx.step = None

    @contextlib.contextmanager
    def stepping(self, step, where: Optional[str] = None, *, eager_only: bool = False):
        """`with context.stepping(step) as plan:` begins `step` (`eager_only` as in `begin`), commits it
        when the block ends (`where` as in `commit`), and aborts it when the block raises (any
        exception, `KeyboardInterrupt` included)."""
        plan = self.begin(step, eager_only=eager_only)
        try:
            yield plan
        except BaseException:
            self.abort()
            raise
        self.commit(where)

    def reset_request(self, request_id: Hashable) -> None:
        self._the_cache("reset_request")
        self.cache.reset_request(request_id)

    def remove_request(self, request_id: Hashable) -> None:
        self._the_cache("remove_request")
        self.cache.remove_request(request_id)

    def __repr__(self):
        return f"{type(self).__name__}({type(self.cache).__name__})"
