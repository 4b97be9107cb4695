"""Quantized slots against unquantized ones on the transformers families of the tests: greedy
`generate()` through a `FlexKVCache` with `slot_dtype=None`, `torch.int8` and `torch.float8_e4m3fn`.

Each family is the tiny random model of `tests/hf_models.py` (2 layers, hidden 32, the family's
own attention layout), prompts of 5, 13 and 22 tokens, 4 sinks + window 8, and 32 new tokens
(a stream several times the window). Reported per family and slot dtype: the largest logit
difference from the unquantized cache over the steps where both streams are still the same
(`max |dlogit|`, with the largest logit magnitude for scale), and the share of generated tokens
that agree with the unquantized cache's.

    python -m benchmarks.quantized_accuracy            # the table (a few minutes on 2 cores)
    python -m benchmarks.quantized_accuracy --markdown
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from test_transformers import FAMILIES  # noqa: E402

from flexkv import SinkWindow  # noqa: E402
from flexkv.integrations.transformers import FlexKVCache  # noqa: E402
from hf_models import CHUNK, LENGTHS, NEW, SINK, WINDOW, left_pad, make_model, prompts  # noqa: E402

SLOT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def generate(model, ids, mask, slot_dtype):
    cache = FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=len(ids), prefill_chunk=CHUNK, block_size=16,
                        slot_dtype=slot_dtype)
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=NEW, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1).double(), cache


def family_rows(family: str) -> list:
    model = make_model(family)
    ids, mask = left_pad(prompts(LENGTHS))
    with torch.no_grad():
        base_tokens, base_logits, base_cache = generate(model, ids, mask, None)
    rows = []
    for name, sd in SLOT_DTYPES.items():
        with torch.no_grad():
            tokens, logits, cache = generate(model, ids, mask, sd)
        worst = 0.0
        for b in range(len(ids)):
            same = (tokens[b] != base_tokens[b]).nonzero()
            upto = NEW if len(same) == 0 else int(same[0]) + 1  # steps whose histories are still equal
            worst = max(worst, float((logits[b, :upto] - base_logits[b, :upto]).abs().max()))
        rows.append(dict(family=family, slots=name, dlogit=worst, scale=float(base_logits.abs().max()),
                         agree=float((tokens == base_tokens).double().mean()),
                         bytes_ratio=cache.manager.slot_bytes / base_cache.manager.slot_bytes,
                         dtype=str(model.dtype).split(".")[-1]))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    head = ("family", "model dtype", "slots", "max |dlogit|", "max |logit|", "tokens agreeing", "stream bytes")
    lines = []
    for family in args.families.split(","):
        try:
            for r in family_rows(family):
                lines.append((r["family"], r["dtype"], r["slots"], f"{r['dlogit']:.3g}", f"{r['scale']:.3g}",
                              f"{100 * r['agree']:.0f}%", f"{r['bytes_ratio']:.2f}x"))
        except Exception as e:  # a family this transformers build cannot run: say so in the table
            lines.append((family, "-", "-", f"not run: {type(e).__name__}: {str(e)[:60]}", "", "", ""))
        print(f"  {family}: done", file=sys.stderr, flush=True)
    if args.markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        print("\n".join("| " + " | ".join(x) + " |" for x in lines))
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
        print("\n".join("  ".join(str(x).ljust(wd) for x, wd in zip(r, widths)) for r in (head, *lines)))


if __name__ == "__main__":
    main()
