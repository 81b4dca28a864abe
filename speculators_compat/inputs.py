"""Checks of the user's input shared by the ``guard-input`` patch (the generator's constructor) and
the runner (the stock script's arguments, :mod:`speculators_compat.run.arguments`): a model path
that is local must be a readable model folder with its ``config.json``, a hub id offline must be
in the hub cache. Each failure is an :class:`~speculators_compat.errors.InvalidInputError` naming
the path, what is missing and, for a path that does not exist, the nearest folder that does.
Nothing here imports torch, vLLM or transformers (``huggingface_hub`` only to read its cache)."""

from __future__ import annotations

import json
import logging
import os
import re

from .errors import InvalidInputError

log = logging.getLogger("speculators_compat")

#: a Hugging Face hub repo id: ``name`` or ``org/name`` (huggingface_hub's validate_repo_id)
HUB_ID = re.compile(r"^(\b[\w\-.]+\b/)?\b[\w\-.]+\b$")
HUB_ID_MAX = 96


def hub_id_shaped(path: str) -> bool:
    """``path`` has the form of a hub repo id (``name`` / ``org/name``)."""
    return (len(path) <= HUB_ID_MAX and bool(HUB_ID.match(path)) and "--" not in path and ".." not in path
            and not path.endswith(".git"))


def is_local(path) -> bool:
    """``path`` names a local folder or file, never a hub repo id."""
    if isinstance(path, os.PathLike):
        return True
    text = str(path)
    return (os.path.isabs(text) or text.startswith(("./", "../", "~")) or text in (".", "..")
            or os.path.exists(text) or not hub_id_shaped(text))


def nearest_existing(path: str) -> str | None:
    """The nearest folder above ``path`` that exists (``None``: none)."""
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
        up = os.path.dirname(parent)
        if up == parent:
            return None
        parent = up
    return parent or None


_nearest_existing = nearest_existing  # the name guard-input used


#: the variables that keep huggingface_hub / transformers off the network, and their true values
OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_TRUE = frozenset({"1", "on", "yes", "true"})


def offline() -> str | None:
    """The variable that makes this process offline (``HF_HUB_OFFLINE=1``, ...), or None."""
    for name in OFFLINE_VARS:
        if os.environ.get(name, "").strip().lower() in _TRUE:
            return name
    return None


def hub_cached(repo_id: str) -> bool:
    """``repo_id``'s config.json is in the local Hugging Face hub cache (what an offline load reads)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return True  # cannot tell: left to transformers
    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id after all
        return False


def check_hub_id(model_path: str) -> None:
    """A hub-id-shaped ``model_path`` that is no local folder: one line says it is tried as a hub
    id (for ``org/name``, which may have been meant as a folder); offline and not in the hub cache,
    :class:`InvalidInputError` names it at once (instead of transformers' retries)."""
    cwd = os.getcwd()
    if "/" in model_path:
        log.info("model %r: no local folder %s exists; trying it as a Hugging Face hub id",
                 model_path, os.path.join(cwd, model_path))
    var = offline()
    if var is not None and not hub_cached(model_path):
        raise InvalidInputError(
            f"model path {model_path!r}: no local folder {os.path.join(cwd, model_path)} exists, and as a Hugging "
            f"Face hub id it is not in the local hub cache while {var}={os.environ[var]} keeps the hub off: give "
            "the model's local folder (absolute, or relative to the working directory), or download it first")


def check_model_path(model_path) -> tuple[str, dict | None]:
    """For a local ``model_path``: the path to use (``~`` expanded) and its parsed
    ``config.json``, or :class:`InvalidInputError` naming the path and what is missing. A hub
    id: ``(model_path, None)``, untouched (checked by :func:`check_hub_id`)."""
    if not is_local(model_path):
        check_hub_id(str(model_path))
        return model_path, None
    given = os.fspath(model_path)
    path = os.path.expanduser(given)
    shown = repr(given) + (f" (= {path})" if path != given else "")
    if not os.path.exists(path):
        near = nearest_existing(path)
        where = f"; the nearest folder that exists is {near}" if near else ""
        hint = "" if hub_id_shaped(given) else " (it is not a Hugging Face hub id 'name' or 'org/name' either)"
        raise InvalidInputError(f"model path {shown} does not exist{where}: expected the model's local folder "
                                f"with its config.json{hint}")
    if not os.path.isdir(path):
        raise InvalidInputError(f"model path {shown} is a file, not a folder: give the model's folder "
                                "(the one with config.json, the weights and the tokenizer)")
    if not os.access(path, os.R_OK | os.X_OK):
        raise InvalidInputError(f"model folder {shown} cannot be read by this user (permission denied)")
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        try:
            names = sorted(os.listdir(path))
        except OSError:
            names = []
        found = (", ".join(names[:8]) + (", ..." if len(names) > 8 else "")) if names else "nothing"
        raise InvalidInputError(f"model folder {shown} has no config.json (found: {found}): it is not a "
                                "Hugging Face model folder")
    try:
        with open(config_file, encoding="utf-8") as fh:
            config = json.load(fh)
    except OSError as exc:
        raise InvalidInputError(f"model folder {shown}: config.json cannot be read ({exc.strerror or exc})") from exc
    except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
        raise InvalidInputError(f"model folder {shown}: config.json is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise InvalidInputError(f"model folder {shown}: config.json holds {type(config).__name__}, not an object")
    return (path if path != given else model_path), config
