"""Every call the stock generator makes into vLLM, read from the installed speculators sources.

A release that adds a required parameter to a constructor, or drops one the stock code passes,
makes the stock code raise ``TypeError`` -- after the executor has started and the model has
loaded (up to 20 minutes). The ``stock-calls`` preflight check binds every call found here
(positional count and keyword names), as edited by the patches that apply (``Patch.calls``:
``v2`` adds ``block_size`` to ``Scheduler(...)``, ``v1`` drops ``kv_cache_specs``...), to the
installed signature, statically (from the vLLM sources) or at runtime (``inspect``), and refuses
before the weight load when one does not bind.

Calls are found with ``ast``: calls of names the generator and worker modules import from vLLM,
and the generator's calls of methods on ``self.executor`` (a ``MultiprocExecutor``) and
``self.scheduler`` (a ``Scheduler``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from ..core.targets import GENERATOR, WORKER

__all__ = ["Call", "stock_calls", "RECEIVERS"]

#: the attributes of the generator that hold vLLM objects, and their classes
RECEIVERS = {"executor": "MultiprocExecutor", "scheduler": "Scheduler"}


@dataclass(frozen=True)
class Call:
    #: the imported name (``"Scheduler"``) or ``"Class.method"`` (``"Scheduler.add_request"``)
    name: str
    #: the vLLM module the (class) name is imported from
    module: str
    positional: int
    keywords: tuple[str, ...]
    line: int
    #: the stock module the call is in
    where: str = GENERATOR

    @property
    def cls(self) -> str:
        return self.name.split(".")[0]

    @property
    def method(self) -> str | None:
        return self.name.split(".", 1)[1] if "." in self.name else None

    def text(self) -> str:
        args = ["…"] * self.positional + [f"{k}=…" for k in self.keywords]
        return f"{self.name}({', '.join(args)})"


def _receiver(node: ast.AST) -> str | None:
    """``"executor"`` for ``self.executor`` (the attribute holding a vLLM object), else None."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr if node.attr in RECEIVERS else None
    return None


def stock_calls(view) -> list[Call]:
    """The distinct vLLM calls of the installed stock generator and worker extension (first
    occurrence of each shape), generator first."""
    out: dict[tuple, Call] = {}
    for target in (GENERATOR, WORKER):
        out.update((key, call) for key, call in _calls(view.speculators, target).items() if key not in out)
    return list(out.values())


def _calls(src, target: str) -> dict[tuple, Call]:
    tree = src.tree(target)
    if tree is None:
        return {}
    imported = {name: module for module, name in src.imports(target, "vllm")}
    classes = {cls: imported.get(cls, "") for cls in RECEIVERS.values()}
    out: dict[tuple, Call] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in imported:
            name, module = func.id, imported[func.id]
        elif target == GENERATOR and isinstance(func, ast.Attribute) and _receiver(func.value):
            cls = RECEIVERS[_receiver(func.value)]
            name, module = f"{cls}.{func.attr}", classes[cls]
        else:
            continue
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            continue  # *args / **kwargs: nothing to bind statically
        keywords = tuple(k.arg for k in node.keywords)
        key = (name, len(node.args), keywords)
        out.setdefault(key, Call(name, module, len(node.args), keywords, node.lineno, target))
    return dict(sorted(out.items(), key=lambda kv: kv[1].line))
