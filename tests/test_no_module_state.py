"""No hidden module-level mutable state in core/, models/, optim/ (issue 32): what a call depends on is passed to it
or held by the object that owns it, so a researcher can tell from a call what it does.

An ``ast`` check over every ``.py`` file there fails on

- a ``global`` statement;
- a module-level name bound to a mutable container or object (a list, dict or set literal or comprehension; a call
  of ``list``/``dict``/``set``/``defaultdict``/``WeakKeyDictionary``/...; an instance of a class) that code mutates
  (``.append``/``.add``/``.update``/``.clear``/``.pop``/... , an item or attribute assignment or deletion, an
  augmented assignment), in its own module or, imported, anywhere in the package;
- a module-level function memoized with ``functools.lru_cache``/``functools.cache`` (a cache every call fills).

Constant tables (dicts and tuples nobody mutates, ``__all__``) are fine. A process-wide fact that genuinely is
process state may stay only as an entry of ``EXCEPTIONS`` below, with its reason.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHECKED = ("core", "models", "optim")
SCANNED_FOR_MUTATION = ("core", "models", "optim", "recipes", "bin")   # where code could mutate a checked module's name

# "path:name" -> why it may stay
EXCEPTIONS = {
    "core/host_memory.py:_process": "glibc's malloc settings are a property of the process, not of a call: the mode "
                                    "this process's allocator was last set to (glibc has no getter for them)",
    "core/host_memory.py:_glibc": "the C library loaded into this process is a fact about the process (looked up "
                                  "once: ctypes.util.find_library runs ldconfig)",
    "core/config.py:_fields": "a pure function of a config class (its fields and resolved annotations), memoized: "
                              "no result depends on the cache, it spares typing.get_type_hints on every key "
                              "(2 ms per config resolved without it)",
}

MUTABLE_CALLS = {"list", "dict", "set", "bytearray", "defaultdict", "OrderedDict", "Counter", "deque", "ChainMap",
                 "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "SimpleNamespace"}
IMMUTABLE_CALLS = {"frozenset", "tuple", "namedtuple", "NamedTuple", "TypeVar", "ParamSpec", "Path", "PurePath",
                   "MappingProxyType", "Enum", "IntEnum", "Fraction", "Decimal", "ContextVar"}
MUTATORS = {"append", "extend", "insert", "remove", "pop", "popitem", "clear", "add", "discard", "update",
            "difference_update", "intersection_update", "symmetric_difference_update", "setdefault", "sort",
            "reverse", "appendleft", "extendleft", "popleft", "__setitem__", "__delitem__", "__setattr__",
            "__delattr__", "__iadd__", "register"}
MEMOIZERS = {"lru_cache", "cache"}


def _files(folders) -> list[Path]:
    return sorted(p for folder in folders for p in (REPO / folder).rglob("*.py"))


def _module(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def _called(node: ast.expr) -> str | None:
    """The last name of what ``node`` calls (``weakref.WeakSet()`` -> ``WeakSet``)."""
    if not isinstance(node, ast.Call):
        return None
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _mutable(value: ast.expr) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    name = _called(value)
    if name is None or name in IMMUTABLE_CALLS:
        return False
    return name in MUTABLE_CALLS or name[:1].isupper()   # an instance of a class


def _top_level(body: list) -> list:
    """The module's statements, into ``if``/``try``/``with`` blocks at module level (not into defs or classes)."""
    out = []
    for stmt in body:
        out.append(stmt)
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = isinstance(stmt, (ast.If, ast.Try, ast.With))
            if block or (field == "body" and isinstance(stmt, ast.ExceptHandler)):
                out.extend(_top_level(getattr(stmt, field, []) or []))
    return out


def _mutable_names(tree: ast.Module) -> set[str]:
    names = set()
    for stmt in _top_level(tree.body):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else \
            [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        value = getattr(stmt, "value", None)
        if value is not None and _mutable(value):
            names.update(t.id for t in targets if isinstance(t, ast.Name) and t.id != "__all__")
    return names


def _memoized(tree: ast.Module) -> list[str]:
    out = []
    for stmt in _top_level(tree.body):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in stmt.decorator_list:
                d = d.func if isinstance(d, ast.Call) else d
                if (d.id if isinstance(d, ast.Name) else getattr(d, "attr", None)) in MEMOIZERS:
                    out.append(stmt.name)
    return out


def _aliases(tree: ast.Module, module: str, owners: dict[str, set[str]]) -> tuple[dict, dict]:
    """``{local name: (owner module, its name)}`` for names imported from a checked module, and ``{local name:
    owner module}`` for checked modules imported whole."""
    names, modules = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            source = node.module if node.level == 0 else ".".join(module.split(".")[:-node.level] + [node.module])
            for a in node.names:
                if source in owners and a.name in owners[source]:
                    names[a.asname or a.name] = (source, a.name)
                elif f"{source}.{a.name}" in owners:
                    modules[a.asname or a.name] = f"{source}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in owners:
                    modules[a.asname or a.name] = a.name
    for name in owners.get(module, ()):
        names[name] = (module, name)
    return names, modules


def _mutated_object(node: ast.AST) -> ast.expr | None:
    """The expression ``node`` mutates in place, if any: ``x`` of ``x.add(..)``, ``x[k] = ..``, ``x.a = ..``,
    ``del x[k]``, ``x += ..``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
        return node.func.value
    targets = []
    if isinstance(node, (ast.Assign, ast.Delete)):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    for t in targets:
        if isinstance(t, (ast.Subscript, ast.Attribute)):
            return t.value
        if isinstance(node, ast.AugAssign) and isinstance(t, ast.Name):
            return t
    return None


def _owner(expr: ast.expr, names: dict, modules: dict):
    if isinstance(expr, ast.Name) and expr.id in names:
        return names[expr.id]
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id in modules:
        return modules[expr.value.id], expr.attr
    return None


def _scan():
    """Every violation, as ``path:line: what``, except the listed ones."""
    parsed = {p: ast.parse(p.read_text(), str(p)) for p in _files(SCANNED_FOR_MUTATION)}
    checked = [p for p in parsed if p.relative_to(REPO).parts[0] in CHECKED]
    paths = {_module(p): p.relative_to(REPO).as_posix() for p in checked}
    owners = {_module(p): _mutable_names(parsed[p]) for p in checked}
    found = []
    for p in checked:
        rel = p.relative_to(REPO).as_posix()
        for node in ast.walk(parsed[p]):
            if isinstance(node, ast.Global):
                found.append(f"{rel}:{node.lineno}: global {', '.join(node.names)}")
        found += [f"{rel}: {name} is memoized (a module-level cache)" for name in _memoized(parsed[p])
                  if f"{rel}:{name}" not in EXCEPTIONS]
    for p, tree in parsed.items():
        rel = p.relative_to(REPO).as_posix()
        names, modules = _aliases(tree, _module(p), owners)
        for node in ast.walk(tree):
            target = _mutated_object(node)
            owner = None if target is None else _owner(target, names, modules)
            if owner is not None and owner[1] in owners.get(owner[0], ()) \
                    and f"{paths[owner[0]]}:{owner[1]}" not in EXCEPTIONS:
                found.append(f"{rel}:{node.lineno}: mutates {paths[owner[0]]}'s module-level {owner[1]}")
    return found


def test_no_module_level_mutable_state():
    found = _scan()
    assert not found, "module-level mutable state (pass it to the call or hold it in the object that owns it):\n" \
                      + "\n".join(found)


def test_the_exceptions_still_exist():
    """Every listed exception names a module-level binding that is still there (a stale entry would hide a new one)."""
    for entry in EXCEPTIONS:
        path, name = entry.split(":")
        tree = ast.parse((REPO / path).read_text())
        bound = {t.id for s in _top_level(tree.body) for t in getattr(s, "targets", [getattr(s, "target", None)])
                 if isinstance(t, ast.Name)}
        bound |= {s.name for s in _top_level(tree.body) if isinstance(s, (ast.FunctionDef, ast.ClassDef))}
        assert name in bound, f"{entry} is listed as an exception but no longer bound there"


def _violations(source: str, module: str = "core.sample") -> list[str]:
    tree = ast.parse(source)
    owners = {module: _mutable_names(tree)}
    names, modules = _aliases(tree, module, owners)
    out = [f"global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    out += [f"memoized {n}" for n in _memoized(tree)]
    for node in ast.walk(tree):
        target = _mutated_object(node)
        owner = None if target is None else _owner(target, names, modules)
        if owner is not None and owner[1] in owners[module]:
            out.append(f"mutates {owner[1]}")
    return out


def test_the_check_catches_what_it_should():
    """The checker itself, on small sources: each kind of hidden state is caught, constants are not."""
    assert _violations("x = 0\ndef f():\n    global x\n    x = 1\n") == ["global x"]
    assert _violations("_seen = set()\ndef f(t):\n    _seen.add(id(t))\n") == ["mutates _seen"]
    assert _violations("_c: dict = {}\ndef f(k, v):\n    _c[k] = v\n") == ["mutates _c"]
    assert _violations("from weakref import WeakKeyDictionary\n_w = WeakKeyDictionary()\n"
                       "def f(k):\n    del _w[k]\n") == ["mutates _w"]
    assert _violations("_l = []\ndef f():\n    _l[:] = [1]\n") == ["mutates _l"]
    assert _violations("class R:\n    pass\n_r = R()\ndef f():\n    _r.x = 1\n") == ["mutates _r"]
    assert _violations("import functools\n@functools.lru_cache(maxsize=None)\ndef f(x):\n    return x\n") \
        == ["memoized f"]
    assert _violations("TABLE = {'a': 1}\n__all__ = ['f']\nMODES = ('a', 'b')\ndef f(k):\n    return TABLE[k]\n"
                       "def g():\n    d = {}\n    d['a'] = 1\n    return d\n") == []
