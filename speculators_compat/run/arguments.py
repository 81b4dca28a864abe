"""The stock data-generation script's paths, checked as soon as it has parsed its arguments.

A typo in ``--target-model-path``, ``--train-data-path`` or ``--output-dir`` would otherwise
surface minutes later, deep in the stock script's preprocessing (``HFValidationError: Repo id
must be in the form ...``), after the output folder was created. :func:`check` runs before the
runner touches the output folder and before the stock script's preprocessing starts, and raises
:class:`~speculators_compat.errors.InvalidInputError` with the generator's own wording (the
nearest folder that exists). :func:`check_early` runs the same checks on the paths spelt out on
the command line before the script runs at all (its imports take 10 s and more):

* ``--target-model-path``: a local path (absolute, ``./``, ``../``, ``~``, or not of a hub id's
  form) must be a readable model folder with its ``config.json`` (the ``guard-input`` check); a
  hub id offline must be in the hub cache; online, one request asks the hub for it (one try,
  a short timeout; the generator's check reuses the answer): no such model, or no hub reachable
  and the model not cached, is an error that says what to do (``HF_HUB_OFFLINE=1`` with a cached
  model, or a local folder);
* ``--train-data-path``: a path that looks like a local file (a folder separator, ``~``, or a
  data file's extension) must exist; a dataset name (``sharegpt``) is left to the script;
* ``--output-dir``: its parent folder must exist (a typo in it would otherwise be created) and
  the folder, if it exists, must be a folder.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from ..errors import InvalidInputError
from ..inputs import HUB_TIMEOUT  # the one request's limit (``SPECULATORS_COMPAT_HUB_TIMEOUT``)

__all__ = ["check", "ArgumentError", "DATA_SUFFIXES", "HUB_TIMEOUT"]

#: the extensions of a local data file (``--train-data-path``)
DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".arrow", ".txt")


class ArgumentError(InvalidInputError):
    """A path among the stock script's arguments that cannot work (the runner exits 2 with it)."""


def _guard():
    from .. import inputs

    return inputs


def _nearest(path: str) -> str:
    near = _guard().nearest_existing(path)
    return f"; the nearest folder that exists is {near}" if near else ""


def check_train_data(value) -> None:
    if not isinstance(value, (str, os.PathLike)):
        return
    text = os.fspath(value)
    local = (os.sep in text or text.startswith("~") or text.lower().endswith(DATA_SUFFIXES))
    path = os.path.expanduser(text)
    if not local or os.path.exists(path):
        return
    raise ArgumentError(f"--train-data-path {text!r} does not exist{_nearest(path)}: expected a local data "
                            "file (or a dataset name the script knows, such as sharegpt)")


def check_output_dir(value) -> None:
    if not isinstance(value, (str, os.PathLike)):
        return
    text = os.fspath(value)
    path = os.path.abspath(os.path.expanduser(text))
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ArgumentError(f"--output-dir {text!r} is a file, not a folder")
        return
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ArgumentError(f"--output-dir {text!r}: its parent folder {parent} does not exist{_nearest(path)}; "
                                f"create it first (mkdir -p {parent}) if that is the folder you mean")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ArgumentError(f"--output-dir {text!r}: its parent folder {parent} cannot be written by this user")


def check(namespace) -> None:
    """Check the paths of the stock script's parsed arguments (see the module docstring)."""
    guard = _guard()
    model = getattr(namespace, "target_model_path", None)
    if isinstance(model, (str, os.PathLike)):
        try:
            guard.check_model_path(model)
        except InvalidInputError as exc:
            raise ArgumentError(f"--target-model-path: {exc}") from None
    check_train_data(getattr(namespace, "train_data_path", None))
    check_output_dir(getattr(namespace, "output_dir", None))


#: the options :func:`check_early` reads from the command line, by their attribute
EARLY = {"--target-model-path": "target_model_path", "--train-data-path": "train_data_path",
         "--output-dir": "output_dir"}


def check_early(argv: list[str]) -> None:
    """:func:`check` on the paths spelt out in the stock script's command line (``--opt VALUE`` or
    ``--opt=VALUE``, the last one given), before the script runs: the stock script imports torch,
    vLLM and speculators (10 s and more) before it parses its arguments. What this does not read
    (an abbreviated option, ``--help``) is checked when the script has parsed them, as before."""
    if any(arg in ("-h", "--help") for arg in argv) or "--" in argv:
        return
    found = {}
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name not in EARLY:
            continue
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                continue  # argparse's to refuse
            value = argv[i + 1]
        found[EARLY[name]] = value
    if found:
        check(SimpleNamespace(**found))
