"""One `cuda_check` correctness workload in this process, under given kernel options, for diagnosing a
CUDA failure without poisoning the rest of a run (a kernel fault leaves the CUDA context unusable).

    CUDA_LAUNCH_BLOCKING=1 python -m benchmarks.cuda_probe decode-tile-T33-gqa4 ship
    python -m benchmarks.cuda_probe decode-tile-T33-gqa4 eager
    python -m benchmarks.cuda_probe decode-tile-T33-gqa4 "opt:{'BLOCK_M': 64}"

Modes: `ship` (compiled, the kernel options flexkv passes), `eager` (no compile), or `opt:<dict>`
(compiled, flexkv's options updated by the dict; a value of None removes that option). Prints one line
of figures, or the traceback.
"""

import ast
import sys
import traceback

import torch

from benchmarks import cuda_check


def main(argv=None) -> int:
    name, mode = (argv or sys.argv[1:])[:2]
    specs = {n: (c, kw, st) for n, c, kw, st, _ in cuda_check.workload_specs(True)}
    if name not in specs:
        print(f"unknown workload {name!r}; one of {sorted(specs)}")
        return 2
    cfg, kw, steps = specs[name]
    device = torch.device("cuda")
    options = None
    if mode.startswith("opt:"):
        extra = ast.literal_eval(mode[4:])
        base = cuda_check.flexkv_options(torch.cuda.get_device_capability())

        def options(q, k, block_mask):
            merged = {**base(q, k, block_mask), **extra}
            return {key: value for key, value in merged.items() if value is not None}

    try:
        r = cuda_check.run_workload(name, cfg, kw, steps, device, torch.bfloat16, options=options,
                                    compiled=mode != "eager")
        print(name, mode, {key: r.get(key) for key in ("ok", "rel_err", "recompiles", "error")})
        return 0 if r.get("ok") else 1
    except Exception:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
