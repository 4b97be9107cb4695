"""How a cache computes attention: `AttentionOptions`, fixed when the cache is built.

A `BoundedKVManager` takes its options once (`BoundedKVManager(config, device,
options=...)`); None gives `AttentionOptions.for_cache(config, device)`, the
defaults for that config, device and torch release. Each step's path then
follows from the options alone (`AttentionOptions.route`): one decision, made
in one place, that a compiled graph specialises on.

==================  =====================================================  =======================
option              what it does                                           default
==================  =====================================================  =======================
`path`              `"auto"`, `"rows"` (`flexkv.cache.paths.row_attention`) or   `"auto"`
                    `"flex"` (one FlexAttention call per layer)
`pack_gqa`          fold each GQA group into the query axis, so a KV head  CPU
                    meets its group's queries in one pass over its keys
`full_blocks`       plan blocks every query reads whole as full blocks     CUDA, "meta"
                    (the kernel skips the mask there)
`epilogue_barrier`  keep a compiled step's elementwise ops on the output   CPU (`EPILOGUE_FUSION`)
                    out of the FlexAttention kernel
`share_flex_kernel` compiled layers share one FlexAttention kernel         CPU (`SHARED_KERNEL`)
                    (`flexkv.cache.paths.kernel_sharing`)
`quantized_keys_    float8 slots compiled on CUDA: the kernel reads key    off
in_kernel`          cells as stored, their scales applied in `score_mod`
`quantized_values_  float8 slots compiled on CUDA: the kernel reads value  off
in_kernel`          cells as stored (two calls, exact: see
                    `flexkv.cache.storage.quantized.value_scaled_attention`)
`cpu_fast_paths`    a cache on the CPU runs the rows path through its      on
                    speed work (`flexkv.cache.cpu.fast_rows_path`,
                    measured on the CPU: docs/benchmarks.md); off, the
                    plain reference (`row_attention.attend_rows`): the
                    same result. Other devices always run the plain
                    reference (the speed work is unmeasured there)
==================  =====================================================  =======================

`"auto"` takes the rows path eagerly (uncompiled FlexAttention forms every
score of the whole layer tensor) and, compiled, for chunked steps (T > 1) on
the CPU, where the gather is cheap next to the chunk's attention and the CPU
FlexAttention kernel is slow for short query blocks; FlexAttention elsewhere.
Learned sinks on the CPU take the rows path under `"auto"` (`CPU_NO_LSE`).
Quantized slots (`BoundedKVConfig.slot_dtype`) on the CPU take the rows path
under `"auto"`, which dequantizes only the cells a row reads, a group of rows
at a time while they are in the CPU's caches (compiled, as one op:
`flexkv.cache.cpu.quantized_rows`); measured, that is several times faster there
than a forced `path="flex"`, which reads a dequantized copy of the layer
(exact, compiled too, at a KV block size the CPU kernel computes exactly).

`TORCH_WORKAROUNDS` lists every torch behaviour flexkv works around, with
the releases it was seen in; the defaults and the code that works around one
name it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ...compiling import TORCH_VERSION
from ..host.layout import cpu_kernel_block_exact
from .kernel_sharing import SHARED_KERNEL_TORCH, shares_flex_kernel

__all__ = ["AttentionOptions", "Route", "TorchWorkaround", "TORCH_WORKAROUNDS", "ATTENTION_PATHS",
           "CPU_FLEX_DTYPES"]

#: The dtypes the compiled CPU FlexAttention kernel lowers (torch 2.11-2.15); others take the rows path there.
CPU_FLEX_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

ATTENTION_PATHS = ("auto", "rows", "flex")


@dataclass(frozen=True)
class TorchWorkaround:
    """A torch behaviour flexkv works around: on which device, seen in which releases, and how."""

    device: str
    #: The releases `(major, minor)` it was seen in, first and last (None: not seen fixed yet).
    seen: tuple
    problem: str
    answer: str


#: Every torch workaround, by name (see `TorchWorkaround`).
TORCH_WORKAROUNDS = {
    "EPILOGUE_FUSION": TorchWorkaround(
        "cpu", ((2, 11), (2, 15)),
        "inductor fuses an elementwise consumer of the output into the CPU FlexAttention template, which "
        "then fails ('Unsupported for epilogue_nodes in CppFlexAttentionTemplate')",
        "`epilogue_barrier`: the output is read through an identity gather inductor does not fuse"),
    "VIEW_OFFSET": TorchWorkaround(
        "cpu", ((2, 11), (2, 15)),
        "the compiled CPU kernel reads a key or value view from its storage's start, ignoring the offset",
        "every layer keeps key and value tensors of its own (`LayerStore.layer_kv`)"),
    "Q_VIEW": TorchWorkaround(
        "cpu", ((2, 13), None),
        "inductor's CPU FlexAttention fails to lower a q that is only a view of another tensor",
        "the scale is applied to q before the call, which makes q a fresh buffer"),
    "FULL_BLOCKS_REQUIRED": TorchWorkaround(
        "cpu", ((2, 13), None),
        "the compiled CPU kernel failed to build without full-block tensors",
        "the CPU kernel always gets the plan's full-block lists (zero counts without full blocks)"),
    "FULL_BLOCKS_SLOW": TorchWorkaround(
        "cpu", ((2, 13), None),
        "the compiled CPU kernel ran slower with full blocks than with every block masked",
        "`full_blocks` is off by default on the CPU"),
    "WIDE_BLOCK_LISTS": TorchWorkaround(
        "cpu", ((2, 13), None),
        "the CPU kernel wants block lists as wide as the layer tensor",
        "the compact plan lists are padded on the device (`flex_call.plan_block_mask`)"),
    "STORAGE_NAMES": TorchWorkaround(
        "cpu", ((2, 13), None),
        "the CPU template names kernel arguments by their storage, merging views of one table",
        "inside the shared region each block list is made a buffer of its own (`clamp_min(0)`)"),
    "CPU_NO_LSE": TorchWorkaround(
        "cpu", ((2, 11), None),
        "the compiled CPU FlexAttention kernel returns no log-sum-exp",
        "learned sinks, attend_lse and a Recall memory joined by log-sum-exp (with a score_mod) take the rows "
        "path on the CPU under path='auto'; a forced path='flex' compiled there is refused by name"),
    "CPU_MASK_CAPTURES": TorchWorkaround(
        "cpu", ((2, 13), None),
        "the CPU FlexAttention lowering does not realize a tensor the mask_mod captures when the graph computes it "
        "('Cannot Append Choice: Pointwise', then NoValidChoicesError); the CUDA lowering realizes them",
        "a captured tensor computed in the graph ends in `torch.cat`, which inductor's CPU lowering always "
        "realizes (`recall_region`), or is made with the plan, outside the graph"),
    "FINALLY_AFTER_HOP": TorchWorkaround(
        "any", ((2, 13), (2, 13)),
        "a compiled frame that sets a global, runs a higher-order op (FlexAttention, torch.cond) and clears the "
        "global in a `finally` block keeps the set and drops the clear (fixed in 2.15): transformers' and the "
        "`kernels` package's compile-time context globals stay set after a compiled forward",
        "the transformers door clears them when a forward's plan ends "
        "(`flexkv.integrations.transformers.registration.release_compile_globals`)"),
    "DYNAMIC_PLAN": TorchWorkaround(
        "any", ((2, 13), (2, 13)),
        "under automatic dynamic shapes (torch.compile's dynamic=None) a recompiled forward makes every plan size a "
        "symbol; one later specialised fails the shared FlexAttention region (InternalTorchDynamoError: KeyError in "
        "invoke_subgraph's stamp_out_subgraph) and an inline CPU call fails its template's epilogue check",
        "a transformers forward through a FlexKVCache compiles with automatic dynamic shapes off "
        "(`flexkv.integrations.transformers.hooks.ModelState.static_shapes`): its graph is shaped by its plan; "
        "kept on 2.15, where dynamo no longer fails, since a plan's sizes are static by design"),
    "CPU_BLOCK_TAIL": TorchWorkaround(
        "cpu", ((2, 13), None),
        "the compiled CPU kernel miscomputes (off by 0.1 to 10, NaN at times) with a KV block size 8 more than a "
        "multiple of its 16-key micro-GEMM tile (8, 24, 40, 136...) once a query reads more than one block",
        "such block sizes take the rows path (`layout.cpu_kernel_block_exact`), and the layout never "
        "picks one by default"),
    "DECODE_TILE": TorchWorkaround(
        "cuda", ((2, 11), None),
        "the decode kernel packs a KV head's query group into one tile and drops every config whose tile does not "
        "divide the 128-row query block: q_len * group > 128 (4-way GQA from 33 queries) leaves none and the "
        "compile fails (NoValidChoicesError / 'Invalid FlexAttention decode kernel options')",
        "such shapes get FORCE_USE_FLEX_ATTENTION (the main kernel) (`kernel_options.flex_kernel_options`)"),
    "KV_TILE": TorchWorkaround(
        "cuda", ((2, 11), None),
        "the main kernel takes BLOCK_N from a per-GPU table without capping it at the KV block size, and both "
        "Triton kernels assert the KV block size is a multiple of BLOCK_N ('Q and KV block size must be "
        "divisible by BLOCK_M and BLOCK_N')",
        "a KV block size that is not a multiple of 128 pins BLOCK_N to its largest power-of-two divisor, at most 64 "
        "(`kernel_options.flex_kernel_options`); sizes not a multiple of 16 are refused"),
    "DECODE_STAGES": TorchWorkaround(
        "cuda", ((2, 13), None),
        "torch's decode config for sm_90/sm_100 means num_stages=3 but a later branch overwrites it with 1, and "
        "num_warps stays 2 whatever the tile (read in the source; not yet timed on a GPU)",
        "with the device's capability given, decode calls get BLOCK_N=64, num_stages=3 on those GPUs and "
        "num_warps by tile (`kernel_options.flex_kernel_options`)"),
    "SHARED_KERNEL": TorchWorkaround(
        "cpu", (SHARED_KERNEL_TORCH, None),
        "the CPU template emits a kernel per layer call (its C++ differs in a buffer name alone)",
        "`share_flex_kernel`: each layer's call is traced as one nested compile region"),
}


class Route(NamedTuple):
    """How one `attend` call computes attention (`AttentionOptions.route`).

    `path`: `"rows"`, `"flex"` (an inline FlexAttention call), `"region"` (the FlexAttention
    call every compiled layer shares) or `"joint"` (a call with joined keys, `flexkv.cache.paths.joint_path`,
    chosen by `AttentionPaths.choose`); `pack_gqa`: the GQA group is folded into the query axis;
    `barrier`: the output is kept apart from the kernel (`epilogue_barrier`).
    """

    path: str
    pack_gqa: bool
    barrier: bool


@dataclass(frozen=True)
class AttentionOptions:
    """How a cache computes attention (module docstring's table); fixed when the cache is built.

    Build it with `AttentionOptions.for_cache(config, device, **changes)` to start from the
    defaults and change only what you name.
    """

    path: str = "auto"
    pack_gqa: bool = False
    full_blocks: bool = False
    epilogue_barrier: bool = False
    share_flex_kernel: bool = False
    #: Quantized float8 slots, compiled on CUDA: FlexAttention reads the key cells as stored, their
    #: scales applied in `score_mod` (values from the dequantized copy unless the next option is
    #: on). Off by default until `benchmarks/cuda_check.py`'s quantized section has shown it correct
    #: and faster on a device.
    quantized_keys_in_kernel: bool = False
    #: Quantized float8 slots, compiled on CUDA: FlexAttention reads the value cells as stored, in two
    #: calls (`quantized.value_scaled_attention`: the scales as a log in `score_mod`, then a second
    #: call over no values for the step's own log-sum-exp). Off by default, as the keys' option.
    quantized_values_in_kernel: bool = False
    #: The rows path through its CPU fast paths (`flexkv.cache.cpu.cpu_fast_rows`: custom ops, group
    #: buffers, host-built one-token geometry and its memos). Off: the plain reference
    #: (`flexkv.cache.paths.row_attention.attend_rows`), which attends exactly the same cells, to read,
    #: debug or compare against. On by default on every device (they were measured on the CPU).
    cpu_fast_paths: bool = True

    def __post_init__(self):
        if self.path not in ATTENTION_PATHS:
            raise ValueError(f"AttentionOptions: path must be one of {ATTENTION_PATHS}, got {self.path!r}")
        for f in dataclasses.fields(self):
            if f.name != "path" and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"AttentionOptions: {f.name} must be a bool, got {getattr(self, f.name)!r}")
        if self.share_flex_kernel and not hasattr(torch.compiler, "nested_compile_region"):
            raise ValueError(
                f"AttentionOptions: share_flex_kernel=True needs torch.compiler.nested_compile_region, which "
                f"torch {torch.__version__} lacks; set share_flex_kernel=False")

    @classmethod
    def for_cache(cls, config, device, **changes) -> "AttentionOptions":
        """The defaults for a cache of `config` on `device` with this torch, then `changes`."""
        del config  # the defaults depend on the device and torch alone today; the config may refine them
        kind = torch.device(device).type
        defaults = cls(
            path="auto",
            pack_gqa=kind == "cpu",
            full_blocks=kind in ("cuda", "meta"),  # "meta" plans as CUDA does; TORCH_WORKAROUNDS["FULL_BLOCKS_SLOW"]
            epilogue_barrier=applies("EPILOGUE_FUSION", kind),
            share_flex_kernel=shares_flex_kernel(kind),
            cpu_fast_paths=True,
        )
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"AttentionOptions: unknown option(s) {unknown}; "
                             f"options are {[f.name for f in dataclasses.fields(cls)]}")
        return dataclasses.replace(defaults, **changes)

    def path_for(self, device_type: str, tokens: int, compiled: bool = True, dtype=None, *,
                 quantized: bool = False, flex_exact: bool = True) -> str:
        """`"rows"` or `"flex"`: the path a step of `tokens` tokens takes, compiled or eagerly. On the
        CPU, a `dtype` the compiled kernel does not lower (`CPU_FLEX_DTYPES`: float64), `quantized`
        slots (the rows path dequantizes only the cells a row reads) and a KV block size it
        miscomputes (`flex_exact=False`, `layout.cpu_kernel_block_exact`) take the rows path."""
        if self.path == "auto":
            cpu = device_type == "cpu"
            rows = not compiled or (cpu and (tokens > 1 or (dtype is not None and dtype not in CPU_FLEX_DTYPES)
                                             or quantized or not flex_exact))
        else:
            rows = self.path == "rows"
        return "rows" if rows else "flex"

    def reaches_flex(self, device_type: str, config, layout) -> bool:
        """Whether some step of a cache of `config` laid out as `layout` takes FlexAttention, eagerly or
        compiled (`path_for`, before the cache's paths exist: what its layout must hold for them)."""
        exact = device_type != "cpu" or cpu_kernel_block_exact(layout.block_size)
        return any(self.path_for(device_type, tokens, compiled, config.dtype, quantized=config.slot_dtype is not None,
                                 flex_exact=exact) == "flex" for tokens in (1, 2) for compiled in (False, True))

    def route(self, device_type: str, tokens: int, group: int, compiled: bool, *, dtype=None,
              flex_exact: bool = True, score_mod: bool = False, sinks: bool = False,
              quantized: bool = False) -> Route:
        """The one decision of how an `attend` call computes attention (`Route`). Refused: a forced
        compiled FlexAttention step at a KV block the CPU kernel miscomputes (`flex_exact=False`)."""
        path = self.path_for(device_type, tokens, compiled, dtype, quantized=quantized, flex_exact=flex_exact)
        if compiled and path == "flex" and not flex_exact:
            raise ValueError(
                f"path='flex' compiled on the CPU at a KV block size of 8 more than a multiple of 16: torch "
                f"{torch.__version__}'s compiled CPU FlexAttention kernel miscomputes such blocks (eagerly it is "
                f"exact); use a block_size that is a multiple of 16 (or None to let flexkv choose), or path='auto' "
                f"or 'rows' (the rows path is exact at any block size)")
        if sinks and device_type == "cpu" and self.path == "auto":
            path = "rows"  # CPU_NO_LSE
        if compiled and path == "flex" and sinks and applies("CPU_NO_LSE", device_type):
            raise ValueError(
                f"path='flex' compiled on the CPU for a call that needs a log-sum-exp (attend_lse, learned sinks, "
                f"a Recall memory or values read as stored): torch {torch.__version__}'s compiled CPU FlexAttention "
                f"kernel returns none; use path='auto' or 'rows' (the rows path returns it)")
        pack = group > 1 and (self.pack_gqa or path == "rows")
        if path == "flex" and compiled and self.share_flex_kernel and not score_mod and not sinks:
            path = "region"
        return Route(path, pack, path != "rows" and compiled and self.epilogue_barrier)


def applies(name: str, device_type: str, version: Optional[tuple] = None) -> bool:
    """Whether workaround `name` is taken on `device_type` with torch `version` (this torch's by default):
    on its device, from the first release it was seen in on."""
    w = TORCH_WORKAROUNDS[name]
    return device_type == w.device and (TORCH_VERSION if version is None else version) >= w.seen[0]
