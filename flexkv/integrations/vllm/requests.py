"""A request's own retention in a vLLM engine with the `flexkv` entry.

The engine's `additional_config["flexkv"]` is the most any request keeps: it sizes the block bound
per request, the pool and admission. A request may keep less, through `SamplingParams.extra_args`
(`options.request_retention`: a smaller sink or window, or its whole prompt as sinks). Such a request:

- is checked where it arrives (`InputProcessor.process_inputs`, in the front-end process), so a
  retention wider than the engine's, or a malformed one, is refused with the reason before vLLM
  admits anything;
- gets a prefix-cache salt of its retention (`salted`), so it resumes only from blocks computed under
  the same retention: past the first eviction, a later layer's keys and values depend on what the
  layers before it attended;
- is attended by its own sink and window: the runner hands every row's retention to attention on
  the step's metadata (`flexkv_rows`, `[rows, 2]`), and `FlexKVCPUImpl` attends such a step on its
  batched path (vLLM's own kernel still takes a step in which no row has evicted anything under its
  own retention). Its blocks follow the engine's retention, which keeps a superset of what it reads.

On CUDA (vLLM's FlexAttention backend, which attends every request by the engine's retention), and under vLLM's
V2 model runner (whose batch this module does not read), a request's own retention is refused where it arrives
(`own_retention_unserved`).
"""

from __future__ import annotations

import torch

from .options import check_engine, request_retention

__all__ = ["install_request_retention", "row_retention", "salted", "own_retention_unserved"]

_UNSET = object()


def _engine(obj, vllm_config):
    """The engine's retention (None: no `flexkv` entry), found once per object: `check_engine` checks the whole
    configuration."""
    got = obj.__dict__.get("_flexkv_engine", _UNSET)
    if got is _UNSET:
        got = obj.__dict__["_flexkv_engine"] = check_engine(vllm_config)
    return got


def salted(salt, retention) -> str:
    """`salt` (a request's `cache_salt`, or None) with `retention` added: blocks hashed under it are found only
    by requests of the same salt and retention."""
    return f"{salt or ''}|flexkv:sink={retention.sink}:window={retention.window}"


def row_retention(runner, engine) -> "torch.Tensor | None":
    """`[rows, 2]` (sink, window) of each request of the runner's batch, in the batch's order, or None when every
    one keeps the engine's retention. A request's retention is read once, kept on its state."""
    batch = runner.input_batch
    out = []
    own = False
    for rid in batch.req_ids[:batch.num_reqs]:
        state = runner.requests.get(rid)
        pol = engine if state is None else state.__dict__.get("_flexkv_retention")
        if pol is None:
            params = state.sampling_params
            extra = params.extra_args if params is not None else None
            pol = request_retention(extra, engine, state.num_prompt_tokens) or engine
            state._flexkv_retention = pol
        own = own or pol != engine
        out.append((pol.sink, pol.window))
    return torch.tensor(out, dtype=torch.long) if own else None


def _padded(rows: torch.Tensor, metadata, engine) -> torch.Tensor:
    """`rows` with the engine's retention for every row the metadata has past the batch's requests (padding)."""
    seq_lens = getattr(metadata, "seq_lens", None)
    extra = 0 if seq_lens is None else seq_lens.shape[0] - rows.shape[0]
    if extra <= 0:
        return rows
    return torch.cat([rows, torch.tensor([[engine.sink, engine.window]], dtype=torch.long).expand(extra, 2)])


def own_retention_unserved(vllm_config, platform) -> str:
    """Why this engine cannot attend a request by a retention of its own ("" where it can): the rows reach
    attention through vLLM's V1 model runner on the CPU platform (`row_retention`), nowhere else yet."""
    if not platform.is_cpu():
        return ("in vLLM's CPU backend only so far (its FlexAttention backend attends every request by the "
                "engine's)")
    if getattr(vllm_config, "use_v2_model_runner", False):
        return "under vLLM's V1 model runner only so far (this engine runs V2: set VLLM_USE_V2_MODEL_RUNNER=0)"
    return ""


def _prompt_len(request) -> int:
    ids = request.prompt_token_ids
    return len(ids) if ids is not None else int(request.prompt_embeds.shape[0])


def install_request_retention() -> None:
    """Wrap vLLM's `InputProcessor.process_inputs` and, on vLLM's CPU platform, `GPUModelRunner._build_attention_metadata`
    (see the module docstring; elsewhere the runner module is left unimported, as vLLM's front-end leaves it). Called
    once, by `plugin.install`."""
    from vllm.exceptions import VLLMValidationError
    from vllm.platforms import current_platform
    from vllm.v1.engine.input_processor import InputProcessor

    own_process = InputProcessor.process_inputs

    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        engine = _engine(self, self.vllm_config)
        extra = getattr(params, "extra_args", None)
        try:
            request_retention(extra, engine)  # a malformed or wider retention is refused before vLLM's own work
        except ValueError as e:
            raise VLLMValidationError(str(e), parameter="extra_args") from None
        request = own_process(self, request_id, prompt, params, *args, **kwargs)
        if engine is not None and extra:
            try:
                pol = request_retention(request.sampling_params.extra_args, engine, _prompt_len(request))
                if pol is not None and pol != engine:
                    why = own_retention_unserved(self.vllm_config, current_platform)
                    if why:
                        raise ValueError(
                            f"extra_args asks for {pol!r}, narrower than the engine's {engine!r}: flexkv serves a "
                            f"request's own retention {why}; drop the request's flexkv keys, or serve it from an "
                            f"engine started with that retention")
            except ValueError as e:
                raise VLLMValidationError(str(e), parameter="extra_args") from None
            if pol is not None and pol != engine:
                request.cache_salt = salted(request.cache_salt, pol)
        return request

    process_inputs.__wrapped__ = own_process
    InputProcessor.process_inputs = process_inputs

    if not current_platform.is_cpu():
        return  # a request's own retention is refused where it arrives: no runner needs to carry one
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # vLLM's CPU runner is one

    own_build = GPUModelRunner._build_attention_metadata

    def build_attention_metadata(self, *args, **kwargs):
        out = own_build(self, *args, **kwargs)
        engine = _engine(self, self.vllm_config)
        rows = row_retention(self, engine) if engine is not None else None
        if rows is not None:
            per_layer = out[0]
            for layers in per_layer if isinstance(per_layer, list) else (per_layer,):
                for metadata in {id(m): m for m in layers.values() if m is not None}.values():
                    metadata.flexkv_rows = _padded(rows, metadata, engine)
        return out

    build_attention_metadata.__wrapped__ = own_build
    GPUModelRunner._build_attention_metadata = build_attention_metadata
