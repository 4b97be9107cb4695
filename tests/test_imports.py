"""flexkv's modules import each other in one direction only: the import graph inside the package is acyclic.

Every import statement counts, wherever it stands: at module level, under
`if TYPE_CHECKING:`, in a class body, and inside a function. A deferred
import inside a function does not run at import time, but it is still a
dependency, and a cycle through it closes the moment someone moves the
import to the top of its module. Only modules of the package are nodes;
`from . import x` and `from .x import y` both count as an edge to `x`.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import flexkv

PACKAGE = Path(flexkv.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path) -> set:
    """The package modules `name` imports, anywhere in its source."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                # `import flexkv.x.y` imports flexkv, flexkv.x and flexkv.x.y
                found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {m for m in found if m in MODULES and m != name}


def find_cycle(graph: dict):
    """One cycle of `graph` as a list of nodes (first == last), or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path)
                if found:
                    return found
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def test_the_finder_sees_a_cycle_through_a_function_level_import(tmp_path):
    """The checker itself: a deferred import closing a cycle is found."""
    src = {"a_probe": "from .b_probe import x\n", "b_probe": "def f():\n    from .a_probe import y\n"}
    for mod, text in src.items():
        (tmp_path / f"{mod}.py").write_text(text)
        MODULES[f"flexkv.{mod}"] = tmp_path / f"{mod}.py"
    try:
        graph = {f"flexkv.{mod}": imports_of(f"flexkv.{mod}", tmp_path / f"{mod}.py") for mod in src}
    finally:
        for mod in src:
            MODULES.pop(f"flexkv.{mod}")
    assert graph == {"flexkv.a_probe": {"flexkv.b_probe"}, "flexkv.b_probe": {"flexkv.a_probe"}}
    assert find_cycle(graph) == ["flexkv.a_probe", "flexkv.b_probe", "flexkv.a_probe"]


def test_no_import_cycle_inside_flexkv():
    graph = {name: imports_of(name, path) for name, path in MODULES.items()}
    assert len(graph) > 15 and "flexkv.session" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_step_is_the_bottom_layer():
    """step.py, which every layer uses, imports nothing from flexkv."""
    assert imports_of("flexkv.step", MODULES["flexkv.step"]) == set()


def test_public_names_are_exported_and_internals_are_not():
    assert set(flexkv.__all__) >= {"StreamSession", "Chunk", "BoundedKVManager", "BoundedKVConfig", "SinkWindow",
                                   "BoundedKVStep", "Segment", "StreamPosition", "SlotsExhausted", "UncachedHistory",
                                   "StepContext", "CacheAttention", "Rotary", "swap_attention"}
    # internals, plans callers never look inside, return types and the serving engine's seams
    assert not set(flexkv.__all__) & {"Layout", "ResourceStep", "Resource", "NodeResourceSpec", "apply_deployment",
                                      "warn_if_untested", "BoundedPlan", "GroupedPlan", "StepResult",
                                      "SwappedAttention", "BoundedKVSpec", "BoundedKVResource", "EngineResourceInfo",
                                      "load_deployment"}
    for name in flexkv.__all__:
        assert getattr(flexkv, name).__module__.startswith("flexkv."), name
    assert set(flexkv.__all__) <= set(dir(flexkv))


def _modules_after(code: str) -> list:
    """The flexkv modules a fresh interpreter holds after running `code`."""
    script = f"import sys\n{code}\nprint(sorted(m for m in sys.modules if m.startswith('flexkv')))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent, env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_import_flexkv_loads_no_layer_until_a_name_is_used():
    """`import flexkv` is two modules; a name loads its own module and what it needs, never the CLI."""
    assert _modules_after("import flexkv") == ["flexkv", "flexkv.compiling"]
    session = _modules_after("from flexkv import StreamSession")
    assert "flexkv.session" in session and "flexkv.cache.manager" in session
    assert not [m for m in session if m.startswith(("flexkv.cli", "flexkv.serving", "flexkv.integrations"))], session
    everything = _modules_after("from flexkv import *")
    assert not [m for m in everything if m.startswith(("flexkv.cli", "flexkv.serving", "flexkv.integrations"))]
    assert "flexkv.serving.distributed" not in _modules_after("from flexkv.serving import BoundedKVSpec")


def test_names_that_left_the_top_level_are_gone():
    """The names `flexkv` exported before 0.2 and later moved to their modules no longer resolve at the
    top (their shims went at 0.1.0); each lives in its own module."""
    from flexkv.cache.host.planner import BoundedPlan  # noqa: F401
    from flexkv.serving import load_deployment  # noqa: F401

    for name in ("BoundedPlan", "load_deployment", "StepResult", "SwappedAttention", "GroupedPlan",
                 "BoundedKVResource", "BoundedKVSpec", "EngineResourceInfo"):
        with pytest.raises(AttributeError, match=f"has no attribute '{name}'"):
            getattr(flexkv, name)
    with pytest.raises(AttributeError, match="has no attribute 'manager'"):
        flexkv.manager  # the flat module paths from before the sub-packages are gone
    assert flexkv.serving.BoundedKVSpec.__module__ == "flexkv.serving.engine"  # a sub-package loads on first use


#: The package in layers, bottom up, as the tree lays it out: a layer is a few top-level modules or
#: a sub-package (every module under it). A module imports only from its own layer or below.
LAYERS = (
    ("foundations: configuration, one step, compiling", ("config", "step", "compiling")),
    ("the cache", ("cache",)),
    ("the model side and the dense reference", ("model",)),
    ("the step loop", ("session",)),
    ("tools, engine seams and integrations", ("", "__main__", "cli", "serving", "integrations")),
)


def layer_of(module: str) -> int:
    short = module[len("flexkv."):] if module.startswith("flexkv.") else ""
    for depth, (_, members) in enumerate(LAYERS):
        if any(short == m or (m and short.startswith(m + ".")) for m in members):
            return depth
    raise AssertionError(f"{module} is in no layer of tests/test_imports.py LAYERS: place it there")


def test_every_module_sits_in_the_folder_of_its_layer():
    """The layers are visible in the tree: nothing of the cache or the model side lies at the top."""
    top = sorted(name for name in MODULES if name.count(".") == 1)
    assert top == ["flexkv.__main__", "flexkv.cache", "flexkv.cli", "flexkv.compiling", "flexkv.config",
                   "flexkv.integrations", "flexkv.model", "flexkv.serving", "flexkv.session", "flexkv.step"]


def test_modules_import_only_their_layer_or_below():
    upward = []
    for name, path in MODULES.items():
        for dep in imports_of(name, path):
            if layer_of(dep) > layer_of(name):
                upward.append(f"{name} ({LAYERS[layer_of(name)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})")
    assert not upward, "imports pointing up a layer:\n" + "\n".join(upward)


#: The cache's sub-packages by role. The host side and the device state never read an attention path; a
#: path reads the host's layout and plan (what a step is), never its tables, lifecycle or transaction; the
#: CPU speed work builds on the plain rows path's pieces only and is entered from one module.
CACHE_ROLES = ("host", "storage", "positions", "paths", "cpu")
HOST_FOR_PATHS = {"flexkv.cache.host.layout", "flexkv.cache.host.planner"}
PLAIN_ROWS_PIECES = {"flexkv.cache.paths.rows_path", "flexkv.cache.paths.row_attention", "flexkv.cache.paths.row_cells"}
CPU_DOOR = {"flexkv.cache.path_choice"}


def cache_role(module: str) -> str:
    parts = module.split(".")
    if parts[:2] != ["flexkv", "cache"]:
        return ""
    return parts[2] if len(parts) > 2 and parts[2] in CACHE_ROLES else "caches"


def cache_rule_breaks(graph: dict) -> list:
    """Each import in `graph` (module -> modules it imports) that breaks a rule of the cache's roles."""
    broken = []
    for name, deps in graph.items():
        role = cache_role(name)
        for dep in deps:
            to = cache_role(dep)
            if to == "caches" and role not in ("caches", ""):
                why = "only the caches and the layers above read the caches"
            elif role in ("host", "storage", "positions") and to in ("paths", "cpu"):
                why = f"the {role} side imports no attention path"
            elif role in ("paths", "cpu") and to == "host" and dep not in HOST_FOR_PATHS:
                why = "a path reads the host's layout and plan only"
            elif role == "cpu" and to == "paths" and dep not in PLAIN_ROWS_PIECES:
                why = "the CPU work imports only the plain rows path's pieces"
            elif to == "cpu" and role != "cpu" and name not in CPU_DOOR:
                why = f"the CPU work is entered from {sorted(CPU_DOOR)} only"
            else:
                continue
            broken.append(f"{name} imports {dep}: {why}")
    return broken


def test_every_cache_module_sits_in_a_role():
    """`flexkv/cache/` holds the caches themselves at its top, everything else in a role's sub-package."""
    top = sorted(n for n in MODULES if n.startswith("flexkv.cache.") and n.count(".") == 2)
    assert top == sorted(["flexkv.cache.attend_modes", "flexkv.cache.cache_group", "flexkv.cache.groups",
                          "flexkv.cache.manager", "flexkv.cache.protocol",
                          "flexkv.cache.path_choice", *(f"flexkv.cache.{role}" for role in CACHE_ROLES)])


def package_of(name: str) -> str:
    """The package a module belongs to (a package's `__init__` is the package itself); a module at the top of
    flexkv stands for itself, since the top holds modules of every layer."""
    package = name if MODULES.get(name, Path("x.py")).name == "__init__.py" else name.rpartition(".")[0]
    return name if package == "flexkv" else package


def package_graph(graph: dict) -> dict:
    """`graph` (module -> modules it imports) with each module replaced by its package."""
    packages = {package_of(n): set() for n in graph}
    for name, deps in graph.items():
        packages.update({package_of(d): packages.get(package_of(d), set()) for d in deps})
        packages[package_of(name)].update(package_of(d) for d in deps if package_of(d) != package_of(name))
    return packages


def test_no_import_loop_between_packages():
    """Packages import each other one way too: acyclic modules can still loop between two packages (a module of
    one imports the other, a module of the other imports back), which is the layering the folders promise."""
    graph = {name: imports_of(name, path) for name, path in MODULES.items()}
    assert find_cycle(package_graph(graph)) is None


def test_the_package_loop_check_sees_a_loop_the_modules_do_not_have():
    graph = {"flexkv.cache.host.lifecycle": {"flexkv.cache.storage.slot_copy"},
             "flexkv.cache.storage.store": {"flexkv.cache.host.layout"},
             "flexkv.cache.storage.slot_copy": set(), "flexkv.cache.host.layout": set()}
    assert find_cycle(graph) is None
    assert find_cycle(package_graph(graph)) == ["flexkv.cache.host", "flexkv.cache.storage", "flexkv.cache.host"]


def test_the_cache_roles_import_as_the_architecture_says():
    graph = {name: imports_of(name, path) for name, path in MODULES.items() if name.startswith("flexkv.cache.")}
    assert cache_rule_breaks(graph) == []


def test_the_cache_role_check_finds_each_kind_of_break():
    """The checker itself, on a hand-made graph with one break of each rule and two allowed imports."""
    graph = {
        "flexkv.cache.host.planner": {"flexkv.cache.paths.flex_call"},
        "flexkv.cache.paths.flex_path": {"flexkv.cache.host.slots", "flexkv.cache.host.planner"},
        "flexkv.cache.cpu.gathered_rows": {"flexkv.cache.paths.flex_call", "flexkv.cache.paths.row_cells",
                                           "flexkv.cache.paths.rows_path"},
        "flexkv.cache.paths.merge": {"flexkv.cache.cpu.gathered_rows"},
        "flexkv.cache.storage.store": {"flexkv.cache.manager"},
    }
    assert cache_rule_breaks(graph) == [
        "flexkv.cache.host.planner imports flexkv.cache.paths.flex_call: the host side imports no attention path",
        "flexkv.cache.paths.flex_path imports flexkv.cache.host.slots: a path reads the host's layout and plan only",
        "flexkv.cache.cpu.gathered_rows imports flexkv.cache.paths.flex_call: "
        "the CPU work imports only the plain rows path's pieces",
        "flexkv.cache.paths.merge imports flexkv.cache.cpu.gathered_rows: "
        "the CPU work is entered from ['flexkv.cache.path_choice'] only",
        "flexkv.cache.storage.store imports flexkv.cache.manager: only the caches and the layers above read the caches",
    ]


#: Run in a fresh interpreter: hide transformers (as a core-only install has it), then collect every test module.
_COLLECT_WITHOUT_TRANSFORMERS = """
import sys

class _NoTransformers:
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" or name.startswith("transformers."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTransformers())
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", sys.argv[1]]))
"""


def test_every_test_module_collects_without_the_transformers_extra():
    """The core-only install (`pip install -e .`) collects the whole suite with no error: the transformers
    test modules skip themselves (through `hf_models`) before they import transformers or the integration."""
    tests = Path(__file__).parent
    out = subprocess.run([sys.executable, "-c", _COLLECT_WITHOUT_TRANSFORMERS, str(tests)], capture_output=True,
                         text=True, cwd=PACKAGE.parent, env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    errors = [line for line in out.stdout.splitlines() if line.startswith("ERROR")]
    assert out.returncode == 0 and not errors, errors or out.stdout[-2000:] + out.stderr[-2000:]
    collected = [line for line in out.stdout.splitlines() if line.startswith("tests/test_transformers")]
    assert not collected, f"collected with transformers hidden: {collected[:3]}"


# ------------------------------------------------------------------ who attends

#: The one module whose code calls a cache's `attend` (docs/architecture.md, `step_context.py`): every door
#: steps its model through a `StepContext`.
ATTEND_OWNER = "flexkv.model.step_context"


def cache_attend_calls(source: str) -> list:
    """Line numbers of `<x>.attend(...)` / `<x>.write_part(...)` calls whose receiver is named like a cache
    (`cache`, `manager`, or ending in either: `self.cache`, `self.manager`, `kv_manager`)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("attend", "write_part"):
            recv = node.func.value
            name = recv.attr if isinstance(recv, ast.Attribute) else recv.id if isinstance(recv, ast.Name) else ""
            if name.endswith(("cache", "manager")):
                lines.append(node.lineno)
    return lines


def test_only_the_step_context_calls_a_cache_attend():
    found = {name: cache_attend_calls(path.read_text(encoding="utf-8")) for name, path in MODULES.items()
             if name != ATTEND_OWNER}
    assert {name: lines for name, lines in found.items() if lines} == {}
    assert cache_attend_calls(MODULES[ATTEND_OWNER].read_text(encoding="utf-8"))  # it does call one


def test_the_attend_caller_check_sees_a_door_calling_the_cache_itself():
    source = ("def forward(self, q, k, v, plan):\n"
              "    a = self.manager.attend(0, q, k, v, plan)\n"
              "    b = cache.write_part(1, k, v, plan)\n"
              "    c = self.context.attend(0, q, k, v)\n"
              "    return group.attend(0, q, k, v, plan), a, b, c\n")
    assert cache_attend_calls(source) == [2, 3]


def long_functions(paths, limit: int = 80) -> list:
    """`(file name, line, function, lines)` of each function or method longer than `limit` lines, docstring
    included."""
    found = []
    for path in paths:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    found.append((Path(path).name, node.lineno, node.name, n))
    return found


def test_no_function_in_the_cache_or_the_transformers_door_runs_past_80_lines():
    paths = sorted((PACKAGE / "cache").rglob("*.py")) + sorted((PACKAGE / "integrations" / "transformers").rglob("*.py"))
    assert long_functions(paths) == []


def test_the_length_check_counts_a_long_function(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(80))
    path = tmp_path / "x.py"
    path.write_text(f"def short():\n    return 1\n\n\nclass A:\n    def long(self):\n{body}\n", encoding="utf-8")
    assert long_functions([path]) == [("x.py", 6, "long", 81)]
