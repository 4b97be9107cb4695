"""One compiled FlexAttention kernel for every layer of a graph.

A model compiled as one graph calls `attend` once per layer, and every
layer's FlexAttention call is the same computation on different buffers.
Inductor's CPU FlexAttention template still emits a kernel per call: it
names the mask's output pointer after the buffer's number in the graph
(`out_ptr{n}`), so the C++ of identical layers differs in that name alone and
each copy (about 60 KB of C++, several seconds of compiler time) is built
again. Traced inside `torch.compiler.nested_compile_region`, a layer's call
is lowered once and the same compiled code is called by every layer, so a
graph of any depth builds one FlexAttention kernel.

`AttentionOptions.share_flex_kernel` (`flexkv.cache.paths.attention_options`) turns it on or off; the default is on
for the CPU with torch 2.13 or later (the release flexkv's compiled tests run
it on), off elsewhere. Calls with a `score_mod` or learned sinks are traced
inline as before (a score_mod is usually a closure over one layer's tensors).
"""

from __future__ import annotations

from typing import Callable

import torch

from ...compiling import TORCH_VERSION

__all__ = ["shares_flex_kernel", "layer_region", "SHARED_KERNEL_TORCH"]


#: The first torch release whose region tracing of a CPU FlexAttention call is tested.
SHARED_KERNEL_TORCH = (2, 13)


def shares_flex_kernel(device_type: str) -> bool:
    """Whether layers share one compiled FlexAttention kernel by default on this device and torch."""
    return (device_type == "cpu" and TORCH_VERSION >= SHARED_KERNEL_TORCH
            and hasattr(torch.compiler, "nested_compile_region"))


def layer_region(fn: Callable) -> Callable:
    """`fn` as a nested compile region (plain `fn` where this torch has none); eager calls run `fn`."""
    region = getattr(torch.compiler, "nested_compile_region", None)
    return fn if region is None else region(fn)
