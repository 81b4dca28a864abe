"""The import graph of the library: no circle, and a one-way boundary between the engine
(``speculators_compat/``) and the patch set (``patches/``, installed as ``speculators_compat.patches``).

Every ``import`` is read with ``ast`` from the source files, function-level ones included (only
``if TYPE_CHECKING:`` blocks are left out: they never run). An edge goes to the module named; a
``from package import name`` goes to ``package.name`` where that is a module.
"""

from __future__ import annotations

import ast
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATCHES = "speculators_compat.patches"


def _modules() -> dict[str, str]:
    """``{dotted name: file}`` of every module of the engine and of the patch set."""
    out = {}
    for top, package in ((os.path.join(ROOT, "speculators_compat"), "speculators_compat"),
                         (os.path.join(ROOT, "patches"), PATCHES)):
        for folder, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            rel = os.path.relpath(folder, top)
            prefix = package if rel == "." else f"{package}.{rel.replace(os.sep, '.')}"
            for name in files:
                if name.endswith(".py"):
                    out[prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"] = os.path.join(folder, name)
    return out


def _runtime_nodes(tree: ast.AST):
    """The nodes of ``tree`` outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        edges = set()
        for node in _runtime_nodes(tree):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
                    else node.module
                for alias in node.names:
                    edges.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def test_the_walk_sees_the_library():
    graph = _graph()
    assert {"speculators_compat.core.hooks", "speculators_compat.core.registry", f"{PATCHES}.vllm_api.v5",
            f"{PATCHES}.features.datapath.shm_transport", f"{PATCHES}.features.datapath._runtime.pool"} <= set(graph)
    assert "speculators_compat.patching" in graph[f"{PATCHES}.guards.worker_death"]
    assert f"{PATCHES}.features.datapath.offload_captured" in graph[f"{PATCHES}.features.datapath.shm_transport"]


#: the engine's layers, bottom first: a package may import its own modules and the layers below,
#: never one above nor another package of its own layer (``errors`` is below them all; ``check``
#: and ``services`` share a layer; the top-level modules -- the package, ``cli``, ``plugin``,
#: ``patching``, ``demo`` -- wire the layers together and may import any)
LAYERS = (("speculators_compat.errors",), ("speculators_compat.core",),
          ("speculators_compat.check", "speculators_compat.services"), ("speculators_compat.run",))


def _layer(name: str) -> tuple[int, str] | None:
    for rank, layer in enumerate(LAYERS):
        for package in layer:
            if name == package or name.startswith(package + "."):
                return rank, package
    return None


def _back_arrows(graph: dict[str, set[str]]) -> list[str]:
    """The edges of ``graph`` from a layer to one above it or to another package of its layer."""
    out = []
    for name, edges in graph.items():
        low = _layer(name)
        for e in sorted(edges):
            high = _layer(e)
            if low is not None and high is not None and (high[0] > low[0] or high[0] == low[0] and high != low):
                out.append(f"{name} -> {e}")
    return out


def test_the_engine_layers_import_downwards_only():
    """core <- check, services <- run: ``core`` imports nothing of ``check``, ``services`` or
    ``run``, ``check`` and ``services`` nothing of each other or of ``run`` (what ``core`` needs
    from above -- the checks, the validation evidence -- is wired in by
    ``speculators_compat/__init__.py``)."""
    graph = _graph()
    assert graph["speculators_compat.check.command"] & {"speculators_compat.core.hooks"}  # the walk sees the layers
    assert not _back_arrows(graph), _back_arrows(graph)


def test_the_layer_rule_catches_a_back_arrow():
    graph = {"speculators_compat.core.registry": {"speculators_compat.check.validation"},
             "speculators_compat.check.checks": {"speculators_compat.core.registry"},
             "speculators_compat.check.command": {"speculators_compat.run.command"},
             "speculators_compat.services.manifest": {"speculators_compat.check.sources",
                                                      "speculators_compat.core.hooks"},
             "speculators_compat.run.command": {"speculators_compat.services.lifecycle"},
             "speculators_compat.cli": {"speculators_compat.run.command"}}
    assert _back_arrows(graph) == ["speculators_compat.core.registry -> speculators_compat.check.validation",
                                   "speculators_compat.check.command -> speculators_compat.run.command",
                                   "speculators_compat.services.manifest -> speculators_compat.check.sources"]


#: the one engine module a patch module imports (its door: ``docs/patches.md``, "Writing a patch")
DOOR = "speculators_compat.patching"


def _through_other_doors(graph: dict[str, set[str]]) -> list[str]:
    return [f"{name} -> {e}" for name, edges in graph.items() if name.startswith(PATCHES)
            for e in sorted(edges) if not e.startswith(PATCHES) and e != DOOR]


def test_patches_reach_the_engine_only_through_the_door():
    graph = _graph()
    assert sum(DOOR in edges for name, edges in graph.items() if name.startswith(PATCHES)) > 40
    assert not _through_other_doors(graph), _through_other_doors(graph)
    assert _through_other_doors({f"{PATCHES}.x.y": {"speculators_compat.core._env", DOOR, f"{PATCHES}._probes"}}) \
        == [f"{PATCHES}.x.y -> speculators_compat.core._env"]


def test_the_engine_parses_no_option_of_a_patch():
    """The patches' environment variables are declared in their modules, not in ``core/_env.py``."""
    import importlib

    import speculators_compat.patching as door
    from speculators_compat.core import _env, hooks

    hooks.patches()  # imports every patch module
    declared = set(door.options())
    assert {"SPECULATORS_COMPAT_SELF_CHECK", "SPECULATORS_COMPAT_SELF_CHECK_TOLERANCE", "SPECULATORS_COMPAT_SHM_DIR",
            "SPECULATORS_COMPAT_HELD_RESULTS", "SPECULATORS_COMPAT_ASYNC_STEPS", "SPECULATORS_COMPAT_DTYPE"} <= declared
    engine = {v for v in vars(importlib.import_module(_env.__name__)).values()
              if isinstance(v, str) and v.startswith("SPECULATORS_COMPAT_")}
    assert not engine & declared, engine & declared


def test_no_engine_module_imports_the_patch_set():
    for name, edges in _graph().items():
        if not name.startswith(PATCHES):
            assert not [e for e in edges if e.startswith(PATCHES)], name


def test_the_imports_form_no_circle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(other):] + [other]))
            if other not in state:
                visit(other)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_setup_cfg_ships_every_package():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    listed = set(cfg["options"]["packages"].split())
    packages = {name for name, path in _modules().items() if path.endswith("__init__.py")}
    assert listed == packages


def _patch_ids() -> set[str]:
    """The id of every patch of the patch set, read from its ``PATCH = declare(...)``: the ``id=`` it
    names, else its module's name (as ``declare`` takes it)."""
    ids = set()
    for name, path in _modules().items():
        if not name.startswith(PATCHES):
            continue
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("Patch", "declare"):
                named = {k.value.value for k in node.keywords if k.arg == "id" and isinstance(k.value, ast.Constant)}
                ids |= named or {name.rpartition(".")[2].replace("_", "-")}
    return ids


#: strings of the engine equal to a patch id that do not name the patch
NOT_A_PATCH = {("speculators_compat.core._env", "self-check"): "the value of SPECULATORS_COMPAT_UNVALIDATED"}


def _names(tree: ast.AST):
    """The string literals of ``tree`` that could name something: not a dict key (a field name) and
    not an entry of ``__all__`` or ``__slots__`` (a Python name)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            skip |= {id(k) for k in node.keys if k is not None}
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) in ("__all__", "__slots__")
                                                    for t in node.targets):
            skip |= {id(n) for n in ast.walk(node.value)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            yield node


def test_the_engine_names_no_patch():
    """The engine (``speculators_compat/``, fixtures in ``testing/`` aside) holds no string equal to
    a patch id: what a patch is and does lives in its module."""
    ids = _patch_ids()
    assert {"v5", "shm-transport", "self-check", "guard-input"} <= ids  # the walk sees the patch set
    offenders = []
    for name, path in _modules().items():
        if name.startswith(PATCHES) or name.startswith("speculators_compat.testing"):
            continue
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        offenders += [f"{name}:{node.lineno} {node.value!r}" for node in _names(tree)
                      if node.value in ids and (name, node.value) not in NOT_A_PATCH]
    assert not offenders, offenders


def test_the_patch_id_rule_catches_a_named_patch():
    tree = ast.parse('A = {"v5": 1}\n__all__ = ["v5"]\nif "v5" in applied: pass\n')
    assert [n.lineno for n in _names(tree) if n.value == "v5"] == [3]
