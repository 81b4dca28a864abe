"""What each patch of a patch set touches, read from its ``apply`` with ``ast`` (no import of the
patched libraries), for the order's property tests and the contract test.

A patch touches ``(owner, name)`` through ``patcher.wrap(owner, name, ...)``, ``patcher.define``
or ``patcher.set_item(mapping, key, ...)``. Owners are named as dotted paths: ``module`` (the
patch's target) becomes the target's name, an imported name its module, ``vars(x)`` the object
``x``, ``getattr(x, CONST)`` ``x.CONST``, ``importlib.import_module(CONST)`` and a helper of the
patch module that returns one become the module's name. An owner this reading cannot name is kept
as ``<patch module>:<source text>`` (it then matches only itself). The names of a loop over a
module-level dict (``for method, wrapper in WRAPPERS.items()``) are the dict's keys; the
``generator_patch(what, WRAPPERS)`` helper of ``patches/_probes.py`` wraps the generator class's
methods named by its dict; an ``apply = wrapping({...})`` (the same module) names what it wraps.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from dataclasses import dataclass

OPS = ("wrap", "define", "set_item")


@dataclass(frozen=True)
class Touch:
    op: str  # wrap, define, set_item
    owner: str
    name: str

    @property
    def key(self) -> tuple[str, str]:
        return self.owner, self.name


def touches(patch) -> set[Touch]:
    """What ``patch``'s apply wraps, defines or sets, read from its module's source."""
    wraps = getattr(patch.apply, "wraps", None)
    if wraps is not None:  # apply = wrapping({...}) of patches/_probes.py: the names it wraps
        return {Touch("wrap", ".".join([patch.target, *path.split(".")[:-1]]), path.rpartition(".")[2])
                for path in wraps}
    module = importlib.import_module(_module_of(patch))
    tree = ast.parse(inspect.getsource(module))
    reader = _Reader(module, tree, patch.target)
    apply = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "apply"), None)
    if apply is None:  # apply = the generator_patch helper's
        return reader.factory()
    return reader.function(apply)


def test_file(patch) -> str:
    """Where ``patch``'s own unit tests live, relative to the checkout:
    ``tests/patches/<group>/test_<module>.py``, its module's file name under its group (the
    folder of ``patches/`` it is in: a data-path patch of ``features/datapath/`` is in ``features``)."""
    parts = _module_of(patch).split(".")
    group = parts[parts.index("patches") + 1] if "patches" in parts[:-1] else parts[-2]
    return f"tests/patches/{group}/test_{parts[-1]}.py"


#: what a patch's test file declares about where the patch is shown needed (tests/test_e2e.py)
EVIDENCE = ("NEEDED", "NEEDED_WHERE", "NEEDED_04", "SHOWN_NEEDED")


def evidence(path, names=EVIDENCE) -> dict:
    """The evidence a test file declares (module-level ``NEEDED = {...}`` & co.), read with ``ast``
    (the file is not imported): ``{patch id or "a,b": ...}``."""
    import ast

    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), str(path))
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) in names for t in node.targets):
            out.update(ast.literal_eval(node.value))
    return out


def _module_of(patch) -> str:
    """The module that declares ``patch`` (its ``PATCH``), whatever module defined its ``apply``."""
    import sys

    modules = list(sys.modules.items())
    # vars(), not getattr(): a lazy module (transformers') imports submodules for unknown names
    declared = [(name, getattr(module, "__dict__", {}).get("PATCH")) for name, module in modules]
    for name, found in declared:
        if found is patch:
            return name
    for name, found in declared:  # a copy of a declaration (dataclasses.replace)
        if getattr(found, "id", None) == patch.id:
            return name
    raise LookupError(f"no imported module declares {patch.id}")


class _Reader:
    def __init__(self, module, tree: ast.Module, target: str) -> None:
        self.module, self.tree, self.target = module, tree, target
        self.imports: dict[str, str] = {}
        self.functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        self._imports(tree.body)

    def _imports(self, body) -> None:
        for node in ast.walk(ast.Module(body=list(body), type_ignores=[])):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    self.imports[alias.asname or alias.name.split(".")[0]] = alias.asname and alias.name or \
                        alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def const(self, node) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and isinstance(getattr(self.module, node.id, None), str):
            return getattr(self.module, node.id)
        return None

    def owner(self, node, local: dict[str, ast.AST]) -> str:
        if isinstance(node, ast.Name):
            if node.id == "module":
                return self.target
            if node.id in local:
                return self.owner(local[node.id], {k: v for k, v in local.items() if k != node.id})
            if node.id in self.imports:
                return self.imports[node.id]
        elif isinstance(node, ast.Attribute):
            return f"{self.owner(node.value, local)}.{node.attr}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = node.args
            if node.func.id == "vars" and len(args) == 1:
                return self.owner(args[0], local)
            if node.func.id == "getattr" and len(args) >= 2 and self.const(args[1]):
                return f"{self.owner(args[0], local)}.{self.const(args[1])}"
            if node.func.id in self.functions and not args:
                returned = self.returns(self.functions[node.func.id])
                if returned is not None:
                    return returned
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module" \
                and node.args and self.const(node.args[0]):
            return self.const(node.args[0])
        return f"{self.module.__name__}:{ast.unparse(node)}"

    def returns(self, function: ast.FunctionDef) -> str | None:
        """What a helper without arguments returns: an imported module or a name imported in it."""
        saved = dict(self.imports)
        self._imports(function.body)
        try:
            for node in ast.walk(function):
                if isinstance(node, ast.Return) and node.value is not None:
                    return self.owner(node.value, {})
            return None
        finally:
            self.imports = saved

    def function(self, function: ast.FunctionDef) -> set[Touch]:
        saved = dict(self.imports)
        self._imports(function.body)
        local: dict[str, ast.AST] = {}
        loops: dict[str, list[str]] = {}
        out: set[Touch] = set()
        for node in ast.walk(function):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                local[node.targets[0].id] = node.value
            elif isinstance(node, ast.For) and isinstance(node.target, ast.Tuple) and node.target.elts \
                    and isinstance(node.target.elts[0], ast.Name):
                loops[node.target.elts[0].id] = self.keys(node.iter)
        for node in ast.walk(function):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "patcher"
                    and node.func.attr in OPS and len(node.args) >= 2):
                continue
            owner = self.owner(node.args[0], local)
            name = node.args[1]
            names = loops.get(name.id, []) if isinstance(name, ast.Name) and name.id in loops else \
                [self.const(name) or f"{self.module.__name__}:{ast.unparse(name)}"]
            out |= {Touch(node.func.attr, owner, n) for n in names}
        self.imports = saved
        return out

    def keys(self, node) -> list[str]:
        """The keys of ``NAME.items()`` / ``NAME`` where NAME is a module-level dict."""
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "items":
            node = node.func.value
        if isinstance(node, ast.Name) and isinstance(getattr(self.module, node.id, None), dict):
            return [str(k) for k in getattr(self.module, node.id)]
        return [f"{self.module.__name__}:{ast.unparse(node)}"]

    def factory(self) -> set[Touch]:
        for node in self.tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                    and getattr(node.value.func, "id", None) == "generator_patch" and len(node.value.args) == 2:
                return {Touch("wrap", f"{self.target}.VllmHiddenStatesGenerator", m)
                        for m in self.keys(node.value.args[1])}
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                    and getattr(node.value.func, "id", None) == "keyword_patch" and node.value.args:
                return {Touch("wrap", self.target, self.const(node.value.args[0]))}
        raise LookupError(f"{self.module.__name__}: no apply(), generator_patch(...) or keyword_patch(...) to read")
