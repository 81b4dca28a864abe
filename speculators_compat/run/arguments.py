"""The stock data-generation script's paths, checked as soon as it has parsed its arguments.

A typo in ``--target-model-path``, ``--train-data-path`` or ``--output-dir`` would otherwise
surface minutes later, deep in the stock script's preprocessing (``HFValidationError: Repo id
must be in the form ...``), after the output folder was created. :func:`check` runs before the
runner touches the output folder and before the stock script's preprocessing starts, and raises
:class:`~speculators_compat.errors.InvalidInputError` with the generator's own wording (the
nearest folder that exists):

* ``--target-model-path``: a local path (absolute, ``./``, ``../``, ``~``, or not of a hub id's
  form) must be a readable model folder with its ``config.json`` (the ``guard-input`` check); a
  hub id offline must be in the hub cache; online, one request asks the hub for it (one try,
  a short timeout): no such model, or no hub reachable and the model not cached, is an error
  that says what to do (``HF_HUB_OFFLINE=1`` with a cached model, or a local folder);
* ``--train-data-path``: a path that looks like a local file (a folder separator, ``~``, or a
  data file's extension) must exist; a dataset name (``sharegpt``) is left to the script;
* ``--output-dir``: its parent folder must exist (a typo in it would otherwise be created) and
  the folder, if it exists, must be a folder.
"""

from __future__ import annotations

import logging
import os

from ..errors import InvalidInputError

__all__ = ["check", "ArgumentError", "DATA_SUFFIXES", "HUB_TIMEOUT"]

#: the extensions of a local data file (``--train-data-path``)
DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".arrow", ".txt")
#: seconds the one request to the hub may take (``SPECULATORS_COMPAT_HUB_TIMEOUT``)
HUB_TIMEOUT = 10.0

log = logging.getLogger("speculators_compat.run")


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


def _hub_timeout() -> float:
    try:
        return float(os.environ.get("SPECULATORS_COMPAT_HUB_TIMEOUT", HUB_TIMEOUT))
    except ValueError:
        return HUB_TIMEOUT


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def check_hub_model(repo_id: str) -> None:
    """One request to the hub for ``repo_id`` (online only; offline, guard-input's cache check)."""
    guard = _guard()
    if guard.offline() is not None:
        return  # check_model_path did the offline check (the hub cache)
    try:
        import huggingface_hub
        from huggingface_hub import errors as hub_errors
    except ImportError:
        return
    try:
        huggingface_hub.model_info(repo_id, timeout=_hub_timeout())
        return
    except hub_errors.GatedRepoError:
        return  # it exists: access is the stock script's (and the token's) business
    except hub_errors.RepositoryNotFoundError:
        raise ArgumentError(
            f"--target-model-path {repo_id!r}: no local folder {os.path.join(os.getcwd(), repo_id)} exists, and the "
            "Hugging Face hub has no model of that id (or it is private: log in with `hf auth login`); give the "
            "model's local folder or an existing hub id") from None
    except hub_errors.HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status is None or status >= 500:
            return  # the hub itself is having trouble: the stock script's own retries may get through
        reason = _first_line(exc)  # e.g. a proxy's 404 for every address: this is not the hub answering
    except Exception as exc:  # noqa: BLE001 - requests', httpx' and the socket's own connection errors
        reason = _first_line(exc)
    if guard.hub_cached(repo_id):
        log.warning("the Hugging Face hub is unreachable (%s): %r is in the local hub cache; run with "
                    "HF_HUB_OFFLINE=1 to load it from there without the hub's retries", reason, repo_id)
        return
    raise ArgumentError(
        f"--target-model-path {repo_id!r}: no local folder {os.path.join(os.getcwd(), repo_id)} exists, and the "
        f"Hugging Face hub cannot be reached to download it ({reason}); give the model's local folder, or download "
        "it where the hub is reachable (`hf download ID`) and run with HF_HUB_OFFLINE=1")


def check(namespace) -> None:
    """Check the paths of the stock script's parsed arguments (see the module docstring)."""
    guard = _guard()
    model = getattr(namespace, "target_model_path", None)
    if isinstance(model, (str, os.PathLike)):
        try:
            guard.check_model_path(model)
        except InvalidInputError as exc:
            raise ArgumentError(f"--target-model-path: {exc}") from None
        if not guard.is_local(model):
            check_hub_model(os.fspath(model))
    check_train_data(getattr(namespace, "train_data_path", None))
    check_output_dir(getattr(namespace, "output_dir", None))
