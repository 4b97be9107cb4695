"""Trained models for flexkv's streaming measurements: loading one, a fixed text, and a stream's perplexity.

`load_pretrained(source)` takes a Hugging Face hub id, a local transformers
folder or a GGUF file (dequantized to float32 by transformers' GGUF support,
which needs the `gguf` and `accelerate` packages: `pip install 'flexkv[real]'`). A GGUF file is
converted once into a float32 transformers folder under the model cache
(`FLEXKV_MODEL_CACHE`, default `~/.cache/flexkv-models/converted`), so later
loads read that folder and take seconds instead of dequantizing again.

`reference_text()` is the text every Python ships (`pydoc_data.topics`,
joined in sorted key order), so anyone can measure the same tokens;
`stream_nll(model, ids, cache)` teacher-forces a token stream through a
model with a cache, chunk by chunk, and returns each token's negative
log-likelihood. docs/real_model.md shows them at work.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Callable, Optional, Tuple

import torch

__all__ = ["DEFAULT_MODEL_CACHE", "load_pretrained", "reference_text", "stream_nll"]

#: where a GGUF file's float32 conversion is kept (`FLEXKV_MODEL_CACHE` overrides it)
DEFAULT_MODEL_CACHE = Path("~/.cache/flexkv-models/converted")

_EXTRA = "pip install 'flexkv[real]'"


def _model_cache(cache_dir) -> Path:
    if cache_dir is None:
        cache_dir = os.environ.get("FLEXKV_MODEL_CACHE") or DEFAULT_MODEL_CACHE
    return Path(cache_dir).expanduser()


def _single_gguf(folder: Path) -> Optional[Path]:
    found = sorted(folder.glob("*.gguf"))
    return found[0] if len(found) == 1 else None


def _from_folder(folder: Path, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model, tokenizer


def _from_gguf(path: Path, dtype, cache_dir) -> Tuple[object, object]:
    stat = path.stat()
    converted = _model_cache(cache_dir) / f"{path.stem}-{stat.st_size}-float32"
    if (converted / "config.json").is_file() and (converted / "model.safetensors").is_file():
        return _from_folder(converted, dtype)
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(
            f"{path} is a GGUF file, which transformers reads with the 'gguf' and 'accelerate' packages; "
            f"{' and '.join(missing)} not installed here: {_EXTRA} (or pip install {' '.join(missing)}), "
            f"or pass a transformers folder or hub id instead"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # transformers marks a dequantized GGUF model as quantized and will not save it; the weights are
    # plain float32 tensors, so rebuild the model from its config without that mark and save that.
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config = type(loaded.config).from_dict(config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    del loaded
    tmp = converted.with_name(converted.name + f".tmp{os.getpid()}")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(converted, ignore_errors=True)  # an unfinished earlier conversion
        tmp.replace(converted)
    except OSError:
        pass  # a read-only or full cache: the model is loaded, only the next load is slower
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model.to(dtype), tokenizer


def load_pretrained(source, *, dtype: torch.dtype = torch.float32, cache_dir=None):
    """`(model, tokenizer)` for a causal LM, in eval mode, on the CPU, in `dtype` (default float32).

    `source` is a GGUF file (or a folder holding exactly one and no
    `config.json`), a local transformers folder (`config.json` and weights),
    or a Hugging Face hub id (`owner/name`, downloaded by transformers, which
    needs the network or a populated hub cache). A GGUF file is dequantized
    once and kept as a float32 folder under `cache_dir` (default
    `FLEXKV_MODEL_CACHE` or `~/.cache/flexkv-models/converted`). Anything
    that cannot be loaded raises `ValueError` saying why and what to pass.
    """
    text = os.fspath(source)
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"model {text!r} is a file but not a GGUF file (*.gguf): pass a GGUF file, a transformers folder "
                f"(with config.json) or a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct"
            )
        model, tokenizer = _from_gguf(path, dtype, cache_dir)
    elif path.is_dir():
        gguf = _single_gguf(path)
        if not (path / "config.json").is_file() and gguf is not None:
            model, tokenizer = _from_gguf(gguf, dtype, cache_dir)
        elif not (path / "config.json").is_file():
            raise ValueError(
                f"model folder {text!r} has no config.json (and not exactly one *.gguf file): pass a transformers "
                f"folder (save_pretrained's output), a GGUF file, or a hub id"
            )
        else:
            model, tokenizer = _from_folder(path, dtype)
    elif text.endswith(".gguf") or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise ValueError(
            f"model {text!r} is not an existing file or folder, nor a hub id of the form owner/name: pass a GGUF "
            f"file, a transformers folder or a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct"
        )
    else:
        try:
            model, tokenizer = _from_folder(text, dtype)
        except OSError as error:
            raise ValueError(
                f"could not load hub model {text!r}: {str(error).splitlines()[0]} -- check the id, or on a machine "
                f"without the hub download the model elsewhere and pass its folder or a GGUF file"
            ) from None
    return model.eval(), tokenizer


def reference_text() -> str:
    """The text of `pydoc_data.topics` (shipped with every CPython), joined in sorted key order by blank lines.

    About 113,000 tokens of English technical prose under SmolLM2's
    tokenizer (113,108 on CPython 3.11.7; the topics change a little between
    Python releases, so state the version with the numbers).
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def stream_nll(model, ids: torch.Tensor, cache, *, chunk: int = 64,
               progress: Optional[Callable[[int], None]] = None) -> torch.Tensor:
    """Each next token's negative log-likelihood, teacher-forcing `ids [1, N]` through `model` with `cache`.

    The stream goes in `chunk` tokens per forward (the cache attends each
    chunk causally, so this equals feeding it token by token); returns a
    float64 tensor of `N - 1` values, entry `i` for predicting `ids[0, i + 1]`.
    `cache` is any transformers `Cache` (None: the model's own growing one).
    `progress(tokens_done)` is called after each chunk.
    """
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must be one stream of shape [1, N], got {tuple(ids.shape)}")
    if cache is None:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
    nll = []
    wide = None  # one float64 buffer for every chunk's logits (see below)
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            piece = ids[:, start:start + chunk + 1]
            logits = model(piece[:, :chunk], cache=cache, use_cache=True).logits[0, :piece.shape[1] - 1]
            if logits.shape[0]:
                # The chunk's logits in float64 go through one buffer made once, not a fresh [chunk, vocab]
                # tensor per forward: with torch on two threads and the CPU busy, glibc served those ~25 MB
                # allocations from ever more arenas and kept them, and a long stream's resident memory climbed
                # by one such buffer every few chunks (24 MiB steps: 1,067 -> 1,716 MiB over 4,096 tokens).
                if wide is None or wide.shape[1] != logits.shape[1]:
                    wide = torch.empty(chunk, logits.shape[1], dtype=torch.float64)
                wide64 = wide[:logits.shape[0]].copy_(logits)
                nll.append(torch.nn.functional.cross_entropy(wide64, piece[0, 1:], reduction="none"))
            if progress is not None:
                progress(min(start + chunk, ids.shape[1]))
    return torch.cat(nll)
