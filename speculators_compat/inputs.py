"""Checks of the user's input shared by the ``guard-input`` patch (the generator's constructor) and
the runner (the stock script's arguments, :mod:`speculators_compat.run.arguments`): a model path
that is local must be a readable model folder with its ``config.json``; a hub id offline must be
in the hub cache, and online one request (one try, ``SPECULATORS_COMPAT_HUB_TIMEOUT`` seconds at
most) asks the hub for it, so that a model the hub does not have, or a hub that cannot be reached
for a model not cached, ends in seconds instead of after transformers' minute of retries. Each
failure is an :class:`~speculators_compat.errors.InvalidInputError` naming the path, what is
missing and what to do (for a path that does not exist, the nearest folder that does). Each id is
asked about once per process (the runner's check and the generator's share the answer), and each
line about it is logged once. Nothing here imports torch, vLLM or transformers (``huggingface_hub``
only, to read its cache and ask the hub)."""

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


#: seconds the one request to the hub may take (``SPECULATORS_COMPAT_HUB_TIMEOUT``)
HUB_TIMEOUT = 10.0
#: what the hub said about each id asked in this process (the runner's and the generator's checks)
_answers: dict[str, tuple[str, str]] = {}
#: the ids whose lines were logged in this process (each line once)
_said: set[tuple[str, str]] = set()


def hub_timeout() -> float:
    """``SPECULATORS_COMPAT_HUB_TIMEOUT`` (seconds; ``0``: no request, the id is left to
    transformers), else :data:`HUB_TIMEOUT`."""
    try:
        value = float(os.environ.get("SPECULATORS_COMPAT_HUB_TIMEOUT", HUB_TIMEOUT))
    except ValueError:
        return HUB_TIMEOUT
    return value if value >= 0 else HUB_TIMEOUT


def _reason(exc: BaseException) -> str:
    """A short reason for a failed request: the OS error it comes down to where the text names one
    (``[Errno 111] Connection refused``), else its first line."""
    text = str(exc).strip()
    errno = re.search(r"\[Errno -?\d+\] [^'\"()\\]+", text)
    if errno:
        return f"{type(exc).__name__}: {errno.group(0).strip()}"
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:200]


def ask_hub(repo_id: str) -> tuple[str, str]:
    """One request to the hub for ``repo_id`` (one try, :func:`hub_timeout` seconds at most):
    ``("found", "")``, ``("missing", "")`` (no such model, or private), ``("unreachable", reason)``
    (no answer from the hub, or one that is not the hub's: a proxy's error page) or
    ``("unknown", reason)`` (``huggingface_hub`` is not installed, or the hub is having trouble:
    left to transformers)."""
    try:
        import huggingface_hub
        from huggingface_hub import errors as hub_errors
    except ImportError:
        return "unknown", "huggingface_hub is not installed"
    try:
        huggingface_hub.model_info(repo_id, timeout=hub_timeout())
        return "found", ""
    except hub_errors.GatedRepoError:
        return "found", ""  # it exists: access is the token's business
    except hub_errors.RepositoryNotFoundError:
        return "missing", ""
    except hub_errors.HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status is None or status >= 500:
            return "unknown", _reason(exc)  # the hub itself is having trouble: transformers' retries may get through
        return "unreachable", _reason(exc)  # e.g. a proxy's 404 for every address: this is not the hub answering
    except Exception as exc:  # noqa: BLE001 - requests', httpx' and the socket's own connection errors
        return "unreachable", _reason(exc)


def _once(repo_id: str, what: str) -> bool:
    key = (repo_id, what)
    if key in _said:
        return False
    _said.add(key)
    return True


def check_hub_id(model_path: str) -> None:
    """A hub-id-shaped ``model_path`` that is no local folder: one line says it is tried as a hub
    id (for ``org/name``, which may have been meant as a folder). Offline and not in the hub cache,
    :class:`InvalidInputError` names it at once. Online, one request asks the hub
    (:func:`ask_hub`): a model the hub does not have, or a hub that cannot be reached while the
    model is not cached, is :class:`InvalidInputError` saying what to do; unreachable but cached,
    one warning suggests ``HF_HUB_OFFLINE=1``. Each id is asked once per process."""
    cwd = os.getcwd()
    folder = os.path.join(cwd, model_path)
    if "/" in model_path and _once(model_path, "tried"):
        log.info("model %r: no local folder %s exists; trying it as a Hugging Face hub id", model_path, folder)
    var = offline()
    if var is not None:
        if not hub_cached(model_path):
            raise InvalidInputError(
                f"model path {model_path!r}: no local folder {folder} exists, and as a Hugging Face hub id it is not "
                f"in the local hub cache while {var}={os.environ[var]} keeps the hub off: give the model's local "
                "folder (absolute, or relative to the working directory), or download it first")
        return
    if hub_timeout() == 0:
        return  # asked not to ask (a mirror without the hub's API, say): transformers' own load tells
    if model_path not in _answers:
        _answers[model_path] = ask_hub(model_path)
    answer, reason = _answers[model_path]
    if answer == "missing":
        raise InvalidInputError(
            f"model path {model_path!r}: no local folder {folder} exists, and the Hugging Face hub has no model of "
            "that id (or it is private: log in with `hf auth login`): give the model's local folder or an existing "
            "hub id")
    if answer != "unreachable":
        return
    if hub_cached(model_path):
        if _once(model_path, "unreachable"):
            log.warning("the Hugging Face hub is unreachable (%s): %r is in the local hub cache; run with "
                        "HF_HUB_OFFLINE=1 to load it from there without the hub's retries", reason, model_path)
        return
    waited = (f"; no answer in {hub_timeout():g} s, SPECULATORS_COMPAT_HUB_TIMEOUT" if "time" in reason.lower()
              else "")
    raise InvalidInputError(
        f"model path {model_path!r}: no local folder {folder} exists, and the Hugging Face hub cannot be reached "
        f"to download it ({reason}{waited}): give the model's local folder, or download it where the hub is "
        "reachable (`hf download ID`) and run with HF_HUB_OFFLINE=1")


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
