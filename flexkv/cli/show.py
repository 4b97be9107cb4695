"""What one step attends, and where each entry lives: the picture behind `flexkv show`.

For a config and a request's position (`source_len`, `written`) and step
(`span`, `T`), `describe_step` plans the step for one request and returns a
`StepPicture`: per query, the stream entries it attends (from
`flexkv.model.reference.attended_indices`, the definition) and, per entry, its
place in the cache (from the plan's row table and write cells): the source
row, the slot's sink region, a ring cell, or one of the step's own tokens.
`render_text` draws it as compact text; `render_png` as an image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..cache.host.layout import Layout, entry_cell
from ..cache.host.planner import build_plan
from ..config import BoundedKVConfig, is_int
from ..model.reference import attended_indices, memory_reach, own_stream_indices
from ..step import BoundedKVStep, Segment, StreamPosition

__all__ = ["StepPicture", "describe_step", "render_text", "render_png", "LEGEND"]

# One character per stream entry and query.
LEGEND = (
    ("S", "source entry (read where the source lives)"),
    ("K", "written entry kept in the slot's sink region"),
    ("W", "written entry in the ring (the window)"),
    ("O", "own token this step writes"),
    ("A", "own look-ahead token (attended, not kept)"),
    ("M", "in memory: read when its block is among the top-k the step chooses"),
    ("L", "left the window, its block not yet whole: read"),
    (".", "not attended"),
)
GRID_MAX = 100  # widest stream drawn one character per entry; longer ones are drawn as runs
MAX_DRAWN = 10_000_000  # longest stream `describe_step` will lay out entry by entry


@dataclass
class StepPicture:
    """Everything `render_text` / `render_png` draw. `marks[t][j]` is the LEGEND letter of entry j for query t."""

    config: BoundedKVConfig
    layout: Layout
    source_len: int
    written: int
    span: int
    tokens: int
    slot: int
    source: int
    n: int
    own: List[int]  # stream index of own token t
    attended: List[List[int]]
    marks: List[str]
    where: List[Tuple[int, int, str, str]]  # (first, last, letter, place) runs over attended entries
    blocks: List[int]
    row: dict


def _runs(values: List[int]) -> List[Tuple[int, int]]:
    """[3,4,5,9,10,0] -> [(3,5),(9,10),(0,0)]: maximal runs of consecutive integers, in order."""
    out: List[Tuple[int, int]] = []
    for v in values:
        if out and v == out[-1][1] + 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))
    return out


def _fmt_runs(values: List[int]) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in _runs(values))


def describe_step(
    config: BoundedKVConfig,
    source_len: int,
    written: int,
    span: int,
    tokens: int,
    *,
    slot: int = 0,
    source: int = 0,
    block_size: Optional[int] = None,
) -> StepPicture:
    """Plan one request's step at this position and say what each query attends and where it lives.

    Raises `ValueError` naming the offending value when the position is not
    one the config allows.
    """
    c = config
    for name, val, lo in (("source_len", source_len, 0), ("written", written, 0), ("span", span, 0),
                          ("T", tokens, 1), ("slot", slot, 0), ("source", source, 0)):
        if not is_int(val) or val < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {val!r}")
    if not c.min_source_len <= source_len <= c.max_source_len:
        raise ValueError(
            f"source_len={source_len} is outside [{c.min_source_len}, {c.max_source_len}] for this config"
        )
    if tokens > c.max_step_tokens:
        raise ValueError(f"T={tokens} exceeds the config's max_step_tokens={c.max_step_tokens}")
    if span > tokens:
        raise ValueError(f"span={span} exceeds T={tokens}; a step writes at most its T tokens")
    if source_len + written + tokens > MAX_DRAWN:
        raise ValueError(
            f"stream of {source_len + written + tokens} entries is too long to draw (at most {MAX_DRAWN}); "
            f"what a step attends repeats once the window has wrapped: try a smaller --written"
        )
    if slot >= c.max_slots:
        raise ValueError(f"slot={slot} is outside [0, {c.max_slots - 1}] (max_slots={c.max_slots})")
    if source_len and source >= c.max_sources:
        raise ValueError(f"source={source} is outside [0, {c.max_sources - 1}] (max_sources={c.max_sources})")

    layout = Layout.for_config(c, block_size)
    step = BoundedKVStep((Segment("r", span),), {"r": StreamPosition(source_len, written, source)}, tokens=tokens)
    plan = build_plan(c, layout, step, lambda rid: slot, "cpu")
    row = plan.row(0)
    n = row["n"]
    own = own_stream_indices(n, span, tokens, c.reverse_step_order)
    attended = attended_indices(c, source_len, written, span, tokens)

    # Where each entry lives: own tokens from the plan's write cells, retained ones from the row table.
    own_at = {}
    for t, cell in enumerate(plan.write_cells(0)):
        j = own[t]
        if j < row["ring_start"]:
            own_at[j] = ("sink cell", cell - row["sink_base"], t)
        else:
            own_at[j] = ("ring cell", cell - row["ring_base"], t)

    def letter_place(j: int) -> Tuple[str, str, int]:
        if j in own_at:
            region, cell, t = own_at[j]
            letter = "O" if t < span else "A"
            return letter, region, cell
        region, _, cell = entry_cell(row, layout.ring_len, j)
        return {"source": "S", "sink": "K", "ring": "W"}[region], (
            f"source {source}" if region == "source" else f"{region} cell"), cell

    width = n + tokens
    marks = []
    for t in range(tokens):
        chars = ["."] * width
        for j in attended[t]:
            chars[j] = letter_place(j)[0]
        if c.recall is not None:  # what a Recall query may read past its window (chosen on the device)
            blocks, tail = memory_reach(c, n, span, t)
            bs, s0 = c.recall.block, c.recall.sink
            for j in range(s0 + blocks.start * bs, s0 + blocks.stop * bs):
                chars[j] = "M"
            for j in tail:
                chars[j] = "L"
        marks.append("".join(chars))
    if c.recall is not None:
        place = letter_place

        def letter_place(j: int) -> Tuple[str, str, int]:
            letter, region, cell = place(j)
            mark = next((m[j] for m in marks if m[j] in "ML"), None)
            return (mark or letter), region, cell

        attended = [[j for j, ch in enumerate(m) if ch != "."] for m in marks]

    everything = sorted(set(j for a in attended for j in a))
    where: List[Tuple[int, int, str, str]] = []
    group: List[Tuple[int, str, str, int]] = []

    def flush():
        if not group:
            return
        first, last = group[0][0], group[-1][0]
        letter, region = group[0][1], group[0][2]
        cells = [g[3] for g in group]
        if region.startswith("source"):
            place = f"{region}, entries {_fmt_runs(cells)}"
        else:
            place = f"{region}{'s' if len(cells) > 1 else ''} {_fmt_runs(cells)}"
        if letter == "A":
            place += " (look-ahead: overwritten by a later step)"
        where.append((first, last, letter, place))
        group.clear()

    for j in everything:
        letter, region, cell = letter_place(j)
        if group and (j != group[-1][0] + 1 or letter != group[-1][1] or region != group[-1][2]):
            flush()
        group.append((j, letter, region, cell))
    flush()

    return StepPicture(
        config=c, layout=layout, source_len=source_len, written=written, span=span, tokens=tokens, slot=slot,
        source=source, n=n, own=own, attended=attended, marks=marks, where=where, blocks=plan.blocks(0), row=row,
    )


def _query_groups(pic: StepPicture) -> List[Tuple[int, int]]:
    """Consecutive queries with identical marks, as (first, last)."""
    groups: List[Tuple[int, int]] = []
    for t, m in enumerate(pic.marks):
        if groups and pic.marks[groups[-1][0]] == m:
            groups[-1] = (groups[-1][0], t)
        else:
            groups.append((t, t))
    return groups


def _mark_runs(marks: str) -> str:
    out = []
    start = 0
    for j in range(1, len(marks) + 1):
        if j == len(marks) or marks[j] != marks[start]:
            rng = f"{start}" if j - 1 == start else f"{start}-{j - 1}"
            out.append(f"{marks[start]} {rng}")
            start = j
    return " | ".join(out)


def render_text(pic: StepPicture, title: Optional[str] = None) -> str:
    """The picture as lines of text (no trailing newline)."""
    c, lay = pic.config, pic.layout
    pol = c.retention_for(pic.source_len)
    lines = []
    if title:
        lines.append(title)
    window = (f"per-query window {c.query_window}" if c.query_window is not None else
              "per-step window, causal inside the step" if c.causal_step else "per-step window")
    lines.append(
        f"retention: {'Recall: ' if c.recall is not None else ''}sink {pol.sink}, window {pol.window}"
        + (" (includes the step)" if pol.window_includes_step else "")
        + f", {window}" + (", reverse step order" if c.reverse_step_order else "")
    )
    def rng(a, b):
        return f"{a}" if a == b else f"{a}-{b}"

    n, span, T = pic.n, pic.span, pic.tokens
    parts = []
    if span:
        parts.append(f"{rng(n, n + span - 1)} written")
    if T > span:
        parts.append(f"{rng(n + span, n + T - 1)} look-ahead")
    own = "own token" if T == 1 else "own tokens"
    lines.append(
        f"position: source_len {pic.source_len}, written {pic.written} -> n = {n}; "
        f"step: span {span}, T {T} -> {own} {rng(n, n + T - 1)} ({', '.join(parts)})"
    )
    memory = "" if c.recall is None else (
        f" + memory {c.recall.memory} + {c.recall.block - 1} for the block leaving the window")
    lines.append(
        f"slot {pic.slot}: sink region {lay.sink_len} cells, ring {lay.ring_len} cells "
        f"(window {c.window_capacity}{memory} + {lay.ring_len - c.window_capacity - c.memory_capacity} for the "
        f"step's own tokens)"
    )
    if c.recall is not None:
        r = c.recall
        lines.append(f"memory: {r.memory_blocks} blocks of {r.block} entries, the {r.top_k} whose mean key scores "
                     f"highest against the step's queries read (per KV head, chosen on the device); through "
                     f"FlexAttention (compiled, or on a GPU) a step copies what it reads of them into its slot row's "
                     f"region ({(r.top_k + 1) * r.block + c.max_step_tokens} cells in whole KV blocks, after the "
                     f"slots) and reads it in the window's one call")
    lines.append("")
    groups = _query_groups(pic)
    label = lambda a, b: f"t={a}" if a == b else f"t={a}-{b}"
    lw = max(len(label(a, b)) for a, b in groups)
    lw = max(lw, len("index"))
    width = len(pic.marks[0])
    if width <= GRID_MAX:
        tens = "".join(str((j // 10) % 10) if j % 10 == 0 else " " for j in range(width))
        ones = "".join(str(j % 10) for j in range(width))
        if width > 10:
            lines.append(f"{'':<{lw}}  {tens}".rstrip())
        lines.append(f"{'index':<{lw}}  {ones}")
        for a, b in groups:
            lines.append(f"{label(a, b):<{lw}}  {pic.marks[a]}")
    else:
        for a, b in groups:
            lines.append(f"{label(a, b):<{lw}}  {_mark_runs(pic.marks[a])}")
    lines.append("")
    lines.append("where:")
    ranges = [f"{f}" if f == l else f"{f}-{l}" for f, l, _, _ in pic.where]
    rw = max(map(len, ranges), default=1)
    for rng, (_, _, letter, place) in zip(ranges, pic.where):
        lines.append(f"  {letter}  {rng:<{rw}}  {place}")
    lines.append(f"KV blocks visited (block {lay.block_size} cells): {_fmt_runs(pic.blocks) or 'none'}")
    used = sorted(set(ch for m in pic.marks for ch in m))
    lines.append("legend: " + ", ".join(f"{ch} {text}" for ch, text in LEGEND if ch in used))
    if c.rows_per_request > 1:
        lines.append(f"(each of the {c.rows_per_request} rows of a request attends the same entries, "
                     f"in its own source row and slot row)")
    return "\n".join(lines)


COLORS = {"S": "#4c78a8", "K": "#f58518", "W": "#54a24b", "O": "#e45756", "A": "#b279a2", "M": "#9d755d",
          "L": "#bab0ac", ".": "#eeeeee"}


def render_png(pic: StepPicture, path: str, title: Optional[str] = None) -> None:
    """Draw the picture (queries x stream entries, coloured by where each lives) into a PNG.

    Needs matplotlib (the `plot` extra); raises ImportError with how to get it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Patch
    except ImportError:
        raise ImportError("drawing a PNG needs matplotlib: pip install 'flexkv[plot]'") from None
    letters = [ch for ch, _ in LEGEND]
    grid = [[letters.index(ch) for ch in m] for m in pic.marks]
    width = len(pic.marks[0])
    fig, ax = plt.subplots(figsize=(min(18, 7 + width * 0.12), 2.2 + 0.35 * len(grid)))
    cmap = ListedColormap([COLORS[ch] for ch in letters])
    ax.imshow(grid, aspect="auto", cmap=cmap, vmin=0, vmax=len(letters) - 1, interpolation="nearest")
    ax.set_xlabel("stream index")
    ax.set_ylabel("query t")
    ax.set_yticks(range(len(grid)))
    ax.set_title(title or f"n = {pic.n}, span {pic.span}, T {pic.tokens}")
    used = sorted(set(ch for m in pic.marks for ch in m), key=letters.index)
    ax.legend(handles=[Patch(color=COLORS[ch], label=f"{ch}: {dict(LEGEND)[ch]}") for ch in used],
              loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
