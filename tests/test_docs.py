"""The docs say what the code does: the signatures they state and the commands they quote.

README.md and docs/*.md state signatures of the public API inline, as the
code declares them: `BoundedKVManager(config, device="cpu", *,
block_size=None)`. Every such statement is checked against
`inspect.signature` of the code: the same parameters in the same order, `*`
where the keyword-only ones begin, and the same defaults (`name=...` says a
parameter has a default without stating it). A code span counts as a
statement when it reads as a parameter list: `Name(...)` for a public name,
with at least one bare parameter name, every default a literal, and a
default, `*` or `**` somewhere, or else exactly the code's parameter names.
A call with values (`SinkWindow(4, 60)`, `SinkWindow(sink=4, window=60)`) or
with placeholders (`SinkWindow(sink, w)`) is an example and is left alone.
Each name in REQUIRED must have a statement somewhere, so a statement that
drifts so far that it no longer reads as one fails too.

Every command line the docs quote (`python ...`, `flexkv ...`, `torchrun
...`) must name a file, module or subcommand that exists, and the options it
passes must be ones that file's (or that subcommand's) parser defines.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import re
import shlex
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional

import pytest
import torch

import flexkv

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# ------------------------------------------------------------------ reading the docs

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_SPAN = re.compile(r"(?<!`)`([^`\n]+(?:\n(?![ \t]*\n)[^`\n]*)*)`(?!`)")


class Span(NamedTuple):
    where: str  # file:line
    text: str  # the span, whitespace collapsed


def _blank(match: re.Match) -> str:
    return "\n" * match.group(0).count("\n")


def inline_spans(path: Path) -> List[Span]:
    """Inline code spans of a Markdown file (a span may run over a line break), outside fenced blocks."""
    text = _FENCE.sub(_blank, path.read_text(encoding="utf-8"))
    return [Span(f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}", " ".join(m.group(1).split()))
            for m in _SPAN.finditer(text)]


def shell_lines(path: Path) -> List[Span]:
    """Command lines of a Markdown file's fenced blocks: every line of a ```bash or ```sh block, the
    `$ `-prompted lines of any other block (the rest is output); `\\` continues a line."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in _FENCE.finditer(text):
        block = m.group(0).split("\n")
        shell = block[0].strip("`~ \t") in ("bash", "sh", "shell")
        first = text.count("\n", 0, m.start()) + 1
        pending, start = "", 0
        for i, line in enumerate(block[1:-1], start=1):
            line = line.strip()
            if not pending:
                if line.startswith("$ "):
                    line = line[2:]
                elif not shell:
                    continue
                start = i
            pending += line
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            out.append(Span(f"{path.name}:{first + start}", " ".join(pending.split())))
            pending = ""
    return out


# ------------------------------------------------------------------ signatures

def _transformers_cache():
    pytest.importorskip("transformers", reason="the transformers integration's signatures need transformers")
    from flexkv.integrations.transformers import FlexKVCache

    return FlexKVCache


def _public() -> Dict[str, Callable[[], object]]:
    """Names a doc may state a signature of -> how to get the object (lazily: the transformers extra is optional)."""
    found = {name: (lambda obj=getattr(flexkv, name): obj) for name in flexkv.__all__
             if callable(getattr(flexkv, name))}
    found.update({name: (lambda obj=getattr(flexkv.serving, name): obj) for name in flexkv.serving.__all__})
    manager = flexkv.BoundedKVManager
    for method in ("attend", "admit", "plan", "commit", "check_start", "add_source", "add_private_source",
                   "reset_request", "remove_request", "remove_source", "remove_private_source"):
        found[method] = found[f"BoundedKVManager.{method}"] = (lambda m=method: getattr(manager, m))
    found["SinkWindow.keys"] = lambda: flexkv.SinkWindow.keys
    found["FlexKVCache"] = _transformers_cache
    return found


PUBLIC = _public()

#: Every one of these has its signature stated somewhere in README.md or docs/.
REQUIRED = ("SinkWindow", "BoundedKVConfig", "BoundedKVManager", "attend", "StreamPosition", "Segment",
            "BoundedKVStep", "StreamSession", "swap_attention", "FlexKVCache")

_UNSTATED = object()  # `name=...`: the doc says there is a default without saying which


def _literal(node: ast.AST):
    """The value of a default as the docs write it, or raise ValueError when it is not a literal."""
    if isinstance(node, ast.Constant) and node.value is Ellipsis:
        return _UNSTATED
    if isinstance(node, ast.Attribute):  # torch.float32
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not (isinstance(node, ast.Name) and node.id == "torch"):
            raise ValueError("not a literal")
        value = torch
        for part in reversed(parts):
            value = getattr(value, part)
        return value
    return ast.literal_eval(node)


class Param(NamedTuple):
    name: str
    kind: str  # "positional", "keyword-only", "*args", "**kwargs"
    default: object  # inspect.Parameter.empty when there is none

    def show(self) -> str:
        if self.kind == "*args":
            return f"*{self.name}"
        if self.kind == "**kwargs":
            return f"**{self.name}"
        if self.default is inspect.Parameter.empty:
            return self.name
        return f"{self.name}={'...' if self.default is _UNSTATED else repr(self.default)}"


def _show(params: List[Param]) -> str:
    out, star = [], False
    for p in params:
        if p.kind == "keyword-only" and not star:
            out.append("*")
        star = star or p.kind in ("keyword-only", "*args")
        out.append(p.show())
    return ", ".join(out)


def doc_params(text: str) -> Optional[List[Param]]:
    """The parameter list a span states, or None when the span is not a parameter list."""
    try:
        tree = ast.parse(f"def _({text}): pass")
    except SyntaxError:
        return None
    a = tree.body[0].args
    positional = a.posonlyargs + a.args
    defaults = [inspect.Parameter.empty] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = []
    try:
        for arg, default in zip(positional, defaults):
            params.append(Param(arg.arg, "positional", default if default is inspect.Parameter.empty
                                else _literal(default)))
        if a.vararg:
            params.append(Param(a.vararg.arg, "*args", inspect.Parameter.empty))
        for arg, default in zip(a.kwonlyargs, a.kw_defaults):
            params.append(Param(arg.arg, "keyword-only", inspect.Parameter.empty if default is None
                                else _literal(default)))
    except (ValueError, TypeError, SyntaxError, AttributeError):
        return None
    if a.kwarg:
        params.append(Param(a.kwarg.arg, "**kwargs", inspect.Parameter.empty))
    return params


_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "positional",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
    inspect.Parameter.KEYWORD_ONLY: "keyword-only",
    inspect.Parameter.VAR_POSITIONAL: "*args",
    inspect.Parameter.VAR_KEYWORD: "**kwargs",
}


def code_params(obj) -> List[Param]:
    """The parameters of a public callable as the code declares them (`self` left out)."""
    if isinstance(obj, type) and obj.__init__ is not object.__init__:
        sig = inspect.signature(obj.__init__)  # not a `__new__(cls, *args, **kwargs)` in front of it
    else:
        sig = inspect.signature(obj)
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    factories = {}
    if dataclasses.is_dataclass(obj):
        factories = {f.name: f.default_factory for f in dataclasses.fields(obj)
                     if f.default_factory is not dataclasses.MISSING}
    out = []
    for p in params:
        default = factories[p.name]() if p.name in factories else p.default
        out.append(Param(p.name, _KINDS[p.kind], default))
    return out


class Statement(NamedTuple):
    where: str
    name: str
    text: str
    params: List[Param]


_CALL = re.compile(r"^([A-Za-z_][\w.]*)\((.*)\)$")


def statements() -> List[Statement]:
    """Every signature a doc states for a public name, where it stands."""
    found = []
    for path in DOCS:
        for span in inline_spans(path):
            m = _CALL.match(span.text)
            if not m or m.group(1) not in PUBLIC:
                continue
            params = doc_params(m.group(2))
            if not params:
                continue
            bare = [p for p in params if p.kind == "positional" and p.default is inspect.Parameter.empty]
            marked = any(p.default is not inspect.Parameter.empty or p.kind != "positional" for p in params)
            if bare and marked:
                found.append(Statement(span.where, m.group(1), span.text, params))
            elif bare and len(bare) == len(params):
                # All bare names: a signature only when they are the code's names (else placeholders).
                try:
                    code = code_params(PUBLIC[m.group(1)]())
                except pytest.skip.Exception:
                    continue
                if [p.name for p in code] == [p.name for p in params]:
                    found.append(Statement(span.where, m.group(1), span.text, params))
    return found


STATEMENTS = statements()


def _same_default(doc, code) -> bool:
    if doc is _UNSTATED:
        return code is not inspect.Parameter.empty
    if (doc is inspect.Parameter.empty) != (code is inspect.Parameter.empty):
        return False
    return doc is code or (type(doc) is type(code) and doc == code) or (
        isinstance(doc, tuple) and isinstance(code, tuple) and doc == code)


def mismatches(doc: List[Param], code: List[Param]) -> List[str]:
    problems = []
    doc_names, code_names = [p.name for p in doc], [p.name for p in code]
    if doc_names != code_names:
        missing = [n for n in code_names if n not in doc_names]
        extra = [n for n in doc_names if n not in code_names]
        problems.append(f"parameters {doc_names} != the code's {code_names}"
                        + (f" (missing {missing})" if missing else "") + (f" (not in the code {extra})" if extra else ""))
        return problems
    for d, c in zip(doc, code):
        if d.kind != c.kind:
            problems.append(f"{d.name} is {d.kind} in the docs, {c.kind} in the code")
        if not _same_default(d.default, c.default):
            problems.append(f"{d.name}: the docs say {d.show()!r}, the code {c.show()!r}")
    return problems


@pytest.mark.parametrize("statement", STATEMENTS, ids=[f"{s.where}:{s.name}" for s in STATEMENTS])
def test_a_stated_signature_is_the_codes(statement: Statement):
    code = code_params(PUBLIC[statement.name]())
    problems = mismatches(statement.params, code)
    assert not problems, (f"{statement.where} states `{statement.text}`; the code is "
                          f"`{statement.name}({_show(code)})`: " + "; ".join(problems))


@pytest.mark.parametrize("name", REQUIRED)
def test_the_docs_state_the_signature_of(name: str):
    PUBLIC[name]()  # skips FlexKVCache without the transformers extra
    aliases = {name, f"BoundedKVManager.{name}"}
    assert any(s.name in aliases for s in STATEMENTS), (
        f"no doc states the signature of {name} in full (`{name}(...)` with its parameters as the code "
        f"declares them); spans naming it: "
        + str([f"{s.where} {s.text}" for p in DOCS for s in inline_spans(p) if s.text.startswith(name + "(")]))


def test_the_signature_checker_sees_drift():
    """The checker itself: a stated default, name or `*` that differs from the code is reported."""
    code = code_params(flexkv.BoundedKVManager)
    assert not mismatches(doc_params('config, device="cpu", *, groups=None, block_size=None, options=None, store=None'), code)
    assert mismatches(doc_params("config, device, groups=None, block_size=128, options=None, store=None"), code) == [
        "device: the docs say 'device', the code \"device='cpu'\"",
        "groups is positional in the docs, keyword-only in the code",
        "block_size is positional in the docs, keyword-only in the code",
        "block_size: the docs say 'block_size=128', the code 'block_size=None'",
        "options is positional in the docs, keyword-only in the code",
        "store is positional in the docs, keyword-only in the code",
    ]
    assert mismatches(doc_params("config, *, groups=None, block_size=None, options=None, store=None"), code)[0].startswith("parameters")
    step = code_params(flexkv.BoundedKVStep)  # positions has a default factory: {}
    assert not mismatches(doc_params("segments, positions={}, tokens=None"), step)
    assert mismatches(doc_params("segments, positions=None, tokens=None"), step)
    assert doc_params("sink=4, window=60") is not None and doc_params("4, 60") is None
    assert doc_params("sink, window=w") is None  # a placeholder value is no default


# ------------------------------------------------------------------ commands

_COMMAND_START = re.compile(r"^(?:[A-Z_]+=\S*\s+)*(python3?|flexkv|torchrun)\s")


def quoted_commands() -> List[Span]:
    """Every command line the docs quote: inline spans and shell blocks, split at `&&`, `;` and `|`."""
    found = []
    for path in DOCS:
        for span in inline_spans(path) + shell_lines(path):
            line = span.text.split(" #")[0]  # a shell comment
            for part in re.split(r"\s*(?:&&|;|\|\|?)\s*", line):
                if _COMMAND_START.match(part):  # a program and at least one argument
                    found.append(Span(span.where, part.strip()))
    return found


COMMANDS = quoted_commands()


def _words(command: str) -> List[str]:
    words = shlex.split(command)
    while words and re.match(r"^[A-Z_]+=", words[0]):  # PYTHONPATH=. and the like
        words.pop(0)
    return [w.strip("[]") for w in words]


def _flags(words: List[str]) -> List[str]:
    return [w.split("=")[0] for w in words if w.startswith("--")]


def _source_defines(path: Path, flags: List[str]) -> List[str]:
    """The flags neither `path` nor a benchmarks module it imports (shared options) names."""
    source = path.read_text(encoding="utf-8")
    for shared in re.findall(r"^from benchmarks\.(\w+) import", source, flags=re.M):
        source += (ROOT / "benchmarks" / f"{shared}.py").read_text(encoding="utf-8")
    return [f for f in flags if f'"{f}"' not in source and f"'{f}'" not in source]


def _module_file(module: str) -> Optional[Path]:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return None


def _flexkv_subcommands() -> Dict[str, set]:
    import argparse

    from flexkv.cli import commands

    parser = commands._parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: set(p._option_string_actions) for name, p in sub.choices.items()}


def check_command(command: str) -> List[str]:
    """What is wrong with a quoted command line: files, modules, subcommands or options that do not exist."""
    words = _words(command)
    program, args = words[0], words[1:]
    if program == "flexkv":
        return _check_flexkv(args)
    if program == "torchrun":
        scripts = [i for i, w in enumerate(args) if w.endswith(".py")]
        if not scripts:
            return [f"torchrun runs no script in `{command}`"]
        return _check_script(args[scripts[0]], args[scripts[0] + 1:])
    while args and args[0] in ("-u", "-O", "-B"):
        args = args[1:]
    if not args or args[0] == "...":  # `python ...`: the command is elided
        return []
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        if module == "flexkv":
            return _check_flexkv(rest)
        path = _module_file(module)
        if path is not None:
            return [f"{path.relative_to(ROOT)} defines no option {f}" for f in _source_defines(path, _flags(rest))]
        if module.split(".")[0] in ("flexkv", "benchmarks", "examples", "tests"):
            return [f"no module {module} in the repository"]
        if importlib.util.find_spec(module) is None:
            return [f"module {module} is not installed"]
        if module == "pytest":
            paths = [w for before, w in zip([""] + rest, rest)
                     if not w.startswith("-") and before not in _PYTEST_OPTIONS_WITH_A_VALUE]
            return [f"pytest is given {w}, which does not exist" for w in paths
                    if not (ROOT / w.split("::")[0]).exists()]
        return []
    return _check_script(args[0], args[1:])


#: pytest's (and pytest-xdist's) options whose value is the next word, not a path to test.
_PYTEST_OPTIONS_WITH_A_VALUE = {"-k", "-m", "-p", "-n", "--numprocesses", "--dist", "--durations", "-c", "-o"}


def _check_script(script: str, rest: List[str]) -> List[str]:
    path = ROOT / script
    if not path.is_file():
        return [f"no file {script}"]
    return [f"{script} defines no option {f}" for f in _source_defines(path, _flags(rest))]


def _check_flexkv(args: List[str]) -> List[str]:
    subcommands = _flexkv_subcommands()
    if not args or args[0].startswith("-"):
        return []
    if args[0] not in subcommands:
        return [f"flexkv has no subcommand {args[0]!r} (it has {sorted(subcommands)})"]
    problems = [f"flexkv {args[0]} has no option {f}" for f in _flags(args[1:]) if f not in subcommands[args[0]]]
    for w in args[1:]:
        if w.endswith((".yaml", ".yml")) and not (ROOT / w).is_file():
            problems.append(f"no workload file {w}")
    return problems


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.where}:{c.text[:60]}" for c in COMMANDS])
def test_a_quoted_command_names_what_exists(command: Span):
    problems = check_command(command.text)
    assert not problems, f"{command.where} quotes `{command.text}`: " + "; ".join(problems)


def test_the_readme_quotes_the_main_commands():
    readme = {c.text.split()[0] + " " + c.text.split()[1] for c in COMMANDS if c.where.startswith("README.md")}
    assert {"flexkv run", "flexkv show", "python -m"} <= readme, readme


def test_the_command_checker_sees_what_is_missing():
    """The checker itself: a file, module, subcommand or option that does not exist is reported."""
    assert check_command("PYTHONPATH=. python examples/streaming_chat.py --rope-positions cache") == []
    assert check_command("python examples/no_such_example.py") == ["no file examples/no_such_example.py"]
    assert check_command("python examples/streaming_chat.py --no-such-flag") == [
        "examples/streaming_chat.py defines no option --no-such-flag"]
    assert check_command("python -m benchmarks.no_such_bench") == ["no module benchmarks.no_such_bench in the repository"]
    assert check_command("flexkv walk") == ["flexkv has no subcommand 'walk' (it has ['run', 'show'])"]
    assert check_command("flexkv show configs/tts-dit.yaml --T 54 --no-such") == ["flexkv show has no option --no-such"]
    assert check_command("python -m pytest -q tests/no_such_test.py") == [
        "pytest is given tests/no_such_test.py, which does not exist"]
    assert check_command("python -m pytest -q -n auto --dist worksteal tests/no_such_test.py") == [
        "pytest is given tests/no_such_test.py, which does not exist"]


# ------------------------------------------------------------------ paths and links

_REPO_PATH = re.compile(r"^(?:\.ci|benchmarks|configs|docs|examples|flexkv|tests)/[\w./{},*-]*$")


def _expand(path: str) -> List[str]:
    """`a/{b,c}.json` -> `a/b.json`, `a/c.json`."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in _expand(path[:m.start()] + alt + path[m.end():])]


def quoted_paths() -> List[Span]:
    """Every repository path the docs quote as code (`flexkv/cache/host/layout.py`, `configs/*.yaml`)."""
    return [span for path in DOCS for span in inline_spans(path) if _REPO_PATH.match(span.text)]


PATHS = quoted_paths()


@pytest.mark.parametrize("quoted", PATHS, ids=[f"{p.where}:{p.text}" for p in PATHS])
def test_a_quoted_path_exists(quoted: Span):
    missing = [p for p in _expand(quoted.text) if not (any(ROOT.glob(p)) if "*" in p else (ROOT / p).exists())]
    assert not missing, f"{quoted.where} quotes `{quoted.text}`, and {missing} does not exist"


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set:
    text = _FENCE.sub(_blank, path.read_text(encoding="utf-8"))
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def links() -> List[Span]:
    """Relative Markdown links of the docs: `[text](docs/models.md#conventions)`, `[text](#tests)`."""
    found = []
    for path in DOCS:
        text = _FENCE.sub(_blank, path.read_text(encoding="utf-8"))
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = m.group(1)
            if not re.match(r"^[a-z]+:", target):
                found.append(Span(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}", target))
    return found


LINKS = links()


@pytest.mark.parametrize("link", LINKS, ids=[f"{s.where}:{s.text}" for s in LINKS])
def test_a_link_points_at_a_file_and_heading_that_exist(link: Span):
    source = ROOT / link.where.rsplit(":", 1)[0]
    file, _, anchor = link.text.partition("#")
    target = (source.parent / file).resolve() if file else source
    assert target.exists(), f"{link.where} links to {link.text}: no file {file}"
    if anchor and target.suffix == ".md":
        assert anchor in _anchors(target), f"{link.where} links to {link.text}: {target.name} has no heading #{anchor}"


def test_the_anchor_of_a_heading_is_githubs():
    assert _anchor("The main command: `flexkv run` and `flexkv show`") == "the-main-command-flexkv-run-and-flexkv-show"
    assert _anchor("4. The configuration") == "4-the-configuration"


# ------------------------------------------------------------------ the package layout

ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _section(path: Path, title: str) -> str:
    text = path.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def test_the_layout_names_every_module_and_only_modules_that_exist():
    """docs/architecture.md's "Package layout" has one line per module: a new, moved or removed module shows there."""
    package = ROOT / "flexkv"
    section = _section(ARCHITECTURE, "Package layout")
    named = {Path(p).name for p in re.findall(r"`((?:[\w]+/)*\w+\.py)`", section) if not p.startswith("tests/")}
    # The transformers integration's modules are listed in its package docstring, not here.
    modules = {p.name for p in package.rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py") and "integrations" not in p.relative_to(package).parts}
    assert modules <= named, f"modules the package layout does not name: {sorted(modules - named)}"
    assert named <= modules, f"the package layout names modules that do not exist: {sorted(named - modules)}"
    tree = re.search(r"```\nflexkv/\n(.*?)```", section, re.S).group(1)
    entries = set(re.findall(r"([\w]+(?:\.py|/))", tree))
    top = {p.name + ("/" if p.is_dir() else "") for p in package.iterdir()
           if p.name not in ("__init__.py", "__main__.py", "__pycache__")}
    assert entries == top, f"the layout's tree {sorted(entries)} is not flexkv/'s top level {sorted(top)}"


# ------------------------------------------------------------------ the README's three front doors

def test_the_readme_shows_the_three_front_doors_in_order_with_code_that_parses():
    """README.md's "Three ways in": transformers, then a model of your own, then engines, each with an example
    that is Python (the examples themselves are run by hand when they change: they compile, which is slow)."""
    section = _section(ROOT / "README.md", "Three ways in")
    doors = re.findall(r"^### (.*)$", section, re.M)
    assert len(doors) == 3, doors
    for door, names in zip(doors, (["FlexKVCache"], ["StreamSession", "swap_attention"], ["StreamCache"])):
        assert all(name in door for name in names), f"the README's door {door!r} should name {names}"
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 3, f"each door has one Python example; found {len(blocks)}"
    for block in blocks:
        ast.parse(block)
