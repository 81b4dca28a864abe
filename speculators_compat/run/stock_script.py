"""The stock offline data-generation script, recognised from its source (``ast``, never run): the
runner gives a recognised script a crash-safe resume and shards (:mod:`.resume`, :mod:`.sharded`)."""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["StockScript", "recognise", "STOCK_FUNCTIONS", "CONFIG", "SAMPLE_LENGTHS"]

#: the files the stock script writes beside its samples (``sample_lengths.json``: speculators 0.4)
CONFIG = "data_config.json"
SAMPLE_LENGTHS = "sample_lengths.json"

#: the functions of the stock script whose behaviour the runner relies on
STOCK_FUNCTIONS = ("find_last_checkpoint", "save_sample_to_disk", "generate_and_save_hidden_states")


@dataclass(frozen=True)
class StockScript:
    """What :func:`recognise` found in a script."""

    path: str
    #: ``"0.3"`` (no sample_lengths.json) or ``"0.4"`` (writes sample_lengths.json)
    variant: str
    #: what differs from the known stock code; empty when the script is recognised
    problems: tuple[str, ...] = ()

    @property
    def known(self) -> bool:
        return not self.problems


def _calls(node: ast.AST) -> list[str]:
    out = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            try:
                out.append(ast.unparse(sub.func))
            except (ValueError, TypeError, AttributeError):  # pragma: no cover - malformed tree
                continue
    return out


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def recognise(path: str | os.PathLike) -> StockScript | None:
    """``None`` if the script is not a data-generation script at all (none of
    :data:`STOCK_FUNCTIONS` is defined); otherwise what was found, with ``problems`` naming
    every way its save/resume code differs from the stock script's (0.3.0, 0.4.x)."""
    try:
        source = Path(path).read_text(encoding="utf-8")
        tree = ast.parse(source, filename=str(path))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    if not any(name in funcs for name in STOCK_FUNCTIONS):
        return None
    problems: list[str] = []
    for name in STOCK_FUNCTIONS:
        if name not in funcs:
            problems.append(f"no function {name}()")
    find = funcs.get("find_last_checkpoint")
    if find is not None:
        text = ast.unparse(find)
        if not {"data_", ".pt"} <= _strings(find) or "max_index + 1" not in text:
            problems.append("find_last_checkpoint() does not resume at max(index) + 1 of data_<i>.pt files")
    save = funcs.get("save_sample_to_disk")
    if save is not None and "torch.save" not in _calls(save):
        problems.append("save_sample_to_disk() does not call torch.save")
    gen = funcs.get("generate_and_save_hidden_states")
    if gen is not None:
        text = ast.unparse(gen)
        if "find_last_checkpoint(args.output_dir)" not in text:
            problems.append("generate_and_save_hidden_states() does not resume from find_last_checkpoint(args.output_dir)")
        if "data_{file_idx}.pt" not in text:
            problems.append("generate_and_save_hidden_states() does not name files data_{file_idx}.pt")
    if CONFIG not in _strings(tree):
        problems.append(f"no {CONFIG}")
    variant = "0.4" if SAMPLE_LENGTHS in _strings(tree) else "0.3"
    return StockScript(str(path), variant, tuple(problems))
