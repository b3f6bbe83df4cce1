"""The layering and size rules of the code, read from the source with ``ast`` (nothing is imported or run).

- Layers (DESIGN.md): bin -> recipes -> models, optim -> core. ``core`` imports and names nothing of
  models/optim/recipes; optim/ and models/ never import recipes; no two modules import each other, directly
  or through others (module-level and function-level imports, relative imports resolved).
- Size: no function over 80 lines, no file over 450 lines, apart from the exceptions listed here with why.
- Progress goes through ``core.io.logging``: no bare ``print``/``click.echo``/``sys.std*.write`` in core/,
  models/ or optim/ outside ``core/io/logging.py`` (the progress function) and ``core/cli/command.py`` (the program's
  help and ``error:`` lines).

Docstrings and comments are not code: they are never read as imports, module names or output.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "models", "optim", "recipes")
# what each package may import besides itself: models/ and optim/ sit side by side above core/ (neither needs
# the other: a model is not an optimizer's business, nor the reverse)
LOWER = {"core": set(), "models": {"core"}, "optim": {"core"}, "recipes": {"core", "models", "optim"}}
# inside core (core/__init__.py): the kernel at the top of core/ imports only itself; each package the kernel
# and the packages before it
CORE_LOWER = {"kernel": set(), "io": {"kernel"}, "data": {"kernel", "io"}, "parallel": {"kernel", "io"},
              "cli": {"kernel", "io", "data", "parallel"}}
MAX_FUNCTION_LINES = 80
KERNEL_FUNCTION_LINES = 60   # core/, models/, optim/: what research code reads (issue 32)
MAX_FILE_LINES = 450
# "path" or "path:function" -> why it may be longer than the limit. Keep it short; empty is best.
SIZE_EXCEPTIONS: dict[str, str] = {}
PRINT_ALLOWED = {"core/io/logging.py": "the progress function itself",
                 "core/cli/command.py": "help text and the error: line",
                 "recipes/generate.py": "the generated text is the recipe's output",
                 "recipes/compress/recipe.py": "the summary table is the recipe's output",
                 "recipes/bench/": "benchmark tables are the recipes' output"}
MODULE_PATH = re.compile(r"^(models|optim|recipes)(\.[A-Za-z_]\w*)+$")  # a dotted module path as a string
IMPORTERS = {"import_module", "__import__", "find_spec"}


@functools.lru_cache(maxsize=None)
def sources() -> dict[str, tuple[Path, ast.Module]]:
    """``module name -> (file, parsed tree)`` for every module of the four packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = (path, ast.parse(path.read_text(), filename=str(path)))
    return out


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def docstrings(tree: ast.Module) -> set[int]:
    """``id`` of every docstring constant (module, class and function docstrings)."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                ids.add(id(first.value))
    return ids


def imported_names(module: str, tree: ast.Module, is_package: bool) -> list[tuple[str, int]]:
    """``(absolute module name, line)`` of every import in ``tree``, at any depth; ``from a import b``
    yields ``a.b`` (the caller keeps it when it is a module, else falls back to ``a``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) \
                and getattr(node.func, "attr", getattr(node.func, "id", None)) in IMPORTERS:
            out.append((node.args[0].value, node.lineno))
    return out


def resolve(name: str, known) -> str | None:
    """The longest prefix of ``name`` that is one of our modules (``a.b.func`` -> ``a.b``)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return None


@functools.lru_cache(maxsize=None)
def import_graph() -> dict[str, dict[str, int]]:
    """``module -> {imported module of ours: line}``."""
    mods = sources()
    graph = {}
    for name, (path, tree) in mods.items():
        edges = {}
        for target, line in imported_names(name, tree, path.name == "__init__.py"):
            target = resolve(target, mods)
            if target is not None and target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One shortest cycle per strongly connected component of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return [shortest_cycle(graph, c) for c in components]


def shortest_cycle(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """A shortest cycle through the first module (by name) of a strongly connected component (BFS)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in graph[node]:
                if child == start:
                    return paths[node] + [start]
                if child in component and child not in paths:
                    paths[child] = paths[node] + [child]
                    following.append(child)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def describe_cycle(cycle: list[str]) -> str:
    graph, mods = import_graph(), sources()
    steps = [f"{rel(mods[a][0])}:{graph[a][b]} imports {b}" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(cycle) + "\n    " + "\n    ".join(steps)


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (break each by moving what both need into one module):\n" + \
        "\n".join(describe_cycle(c) for c in found)


def test_layers_import_only_downwards():
    mods, bad = sources(), []
    for name, edges in import_graph().items():
        layer = name.split(".")[0]
        for target, line in edges.items():
            if target.split(".")[0] not in LOWER[layer] | {layer}:
                bad.append(f"{rel(mods[name][0])}:{line} imports {target} ({layer} must not depend on it)")
    assert not bad, "\n".join(bad)


def core_part(module: str) -> str:
    """``core.io.cache`` -> ``io``; a module at the top of core/ -> ``kernel``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in CORE_LOWER) else "kernel"


def test_core_packages_import_only_downwards():
    mods, bad = sources(), []
    for name, edges in import_graph().items():
        if not name.startswith("core.") or name == "core":
            continue
        part = core_part(name)
        for target, line in edges.items():
            if target.startswith("core.") and core_part(target) not in CORE_LOWER[part] | {part}:
                bad.append(f"{rel(mods[name][0])}:{line} imports {target} (core.{part} must not depend on it)")
    assert not bad, "\n".join(bad)


def test_core_names_no_upper_module():
    """A module path kept as a string (a registry, ``importlib.import_module("models.x")``) is a dependency too."""
    bad = []
    for name, (path, tree) in sources().items():
        if not name.startswith("core"):
            continue
        skip = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip \
                    and MODULE_PATH.match(node.value):
                bad.append(f"{rel(path)}:{node.lineno} names {node.value!r}")
        for target, line in imported_names(name, tree, path.name == "__init__.py"):
            if target.split(".")[0] in ("models", "optim", "recipes"):
                bad.append(f"{rel(path)}:{line} imports {target}")
    assert not bad, "core must not know models, optim or recipes:\n" + "\n".join(sorted(set(bad)))


def test_functions_and_files_are_small():
    long = []
    for name, (path, tree) in sources().items():
        n_lines = len(path.read_text().splitlines())
        if n_lines > MAX_FILE_LINES and rel(path) not in SIZE_EXCEPTIONS:
            long.append(f"{rel(path)}: {n_lines} lines (limit {MAX_FILE_LINES})")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                limit = MAX_FUNCTION_LINES if rel(path).startswith("recipes/") else KERNEL_FUNCTION_LINES
                if n > limit and f"{rel(path)}:{node.name}" not in SIZE_EXCEPTIONS:
                    long.append(f"{rel(path)}:{node.lineno} {node.name}: {n} lines (limit {limit})")
    assert not long, "split these (or list one in SIZE_EXCEPTIONS with the reason):\n" + "\n".join(long)


def is_bare_output(call: ast.Call) -> bool:
    """``print(...)``, ``click.echo(...)``, ``sys.stdout.write(...)`` or ``sys.stderr.write(...)``."""
    f = call.func
    if isinstance(f, ast.Name):
        return f.id == "print"
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        return f.value.id == "click" and f.attr == "echo"
    return (isinstance(f, ast.Attribute) and f.attr == "write" and isinstance(f.value, ast.Attribute)
            and f.value.attr in ("stdout", "stderr") and isinstance(f.value.value, ast.Name)
            and f.value.value.id == "sys")


def test_progress_goes_through_core_logging():
    bad = []
    for name, (path, tree) in sources().items():
        if any(rel(path) == allowed or (allowed.endswith("/") and rel(path).startswith(allowed))
               for allowed in PRINT_ALLOWED):
            continue
        bad += [f"{rel(path)}:{node.lineno}" for node in ast.walk(tree)
                if isinstance(node, ast.Call) and is_bare_output(node)]
    assert not bad, "print progress with core.io.logging.progress (or a Logger's print):\n" + "\n".join(bad)
