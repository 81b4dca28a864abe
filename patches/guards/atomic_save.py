"""atomic-save -- every file the stock script writes into a crash-safe output folder appears complete or not at all.

Problem: not a vLLM delta; the stock ``scripts/data_generation_offline.py`` (speculators 0.3.0,
0.4.x) saves each sample with ``torch.save(data, "<output-dir>/data_<i>.pt")`` on 4 threads
and writes ``data_config.json`` with ``Path.write_text``, both straight to the final name. A
run killed during a save leaves a truncated file under the final name, which its
``max(index) + 1`` resume counts as done, and which the trainer later fails to load (or
loads nothing useful from).

How: ``torch.save``, ``pathlib.Path.write_text`` and ``pathlib.Path.write_bytes`` are
wrapped. A write whose destination is a path directly inside a folder registered with
:func:`speculators_compat.services.atomic.protect` -- ``speculators-compat run`` registers the
stock script's ``--output-dir`` -- goes to a temporary file in the same folder
(``.<name>.<random>.tmp``), which is fsynced, given the permissions ``open()`` would give
it, and renamed over the final name (:func:`speculators_compat.services.atomic.atomic_path`). Any
other destination (a file object, another folder, every write when nothing is registered)
goes through unchanged. A kill leaves at most a temporary file, which the next run's resume
sets aside.

Detection: ``torch.save`` takes ``(obj, f, ...)``; ``Path.write_text`` / ``write_bytes``
take ``(data, ...)``. A guard that does not depend on the vLLM release: applied wherever its
probe finds these calls.

Covers: speculators 0.3.x and 0.4.x from vLLM 0.11.1 on (the same torch and stdlib calls on
every release).

Remove when the stock script saves atomically (not in speculators 0.3.0 - 0.4.x).
"""

from __future__ import annotations

import inspect
import pathlib

from speculators_compat.patching import Kind, Probe, declare

from .._ranges import SPECULATORS_ALL


def _judge(save_params: list[str] | None) -> Probe:
    if not save_params or save_params[:2] != ["obj", "f"]:
        return Probe.unknown(f"torch.save takes {save_params}, expected (obj, f, ...)")
    for method in ("write_text", "write_bytes"):
        names = list(inspect.signature(getattr(pathlib.Path, method)).parameters)
        if names[:2] != ["self", "data"]:
            return Probe.unknown(f"pathlib.Path.{method} takes {names}, expected (self, data, ...)")
    return Probe.new("torch.save(obj, f) and Path.write_text/write_bytes(data): writes into the run's output folder are made atomic")


def probe(module) -> Probe:
    import torch

    return _judge(list(inspect.signature(torch.save).parameters))


def static_probe(view) -> Probe:
    from speculators_compat.patching import Sources

    params = Sources("torch").params("torch.serialization", "save")
    return _judge(list(params) if params else None)


def _torch_save(wrapped, instance, args, kwargs):
    from speculators_compat.patching import atomic

    in_kwargs = "f" in kwargs
    target = kwargs["f"] if in_kwargs else (args[1] if len(args) > 1 else None)
    final = atomic.protected(target)
    if final is None:
        return wrapped(*args, **kwargs)
    with atomic.atomic_path(final) as tmp:
        if in_kwargs:
            return wrapped(*args, **{**kwargs, "f": tmp})
        return wrapped(args[0], tmp, *args[2:], **kwargs)


def _path_write(wrapped, instance, args, kwargs):
    from speculators_compat.patching import atomic

    final = atomic.protected(instance)
    if final is None:
        return wrapped(*args, **kwargs)
    with atomic.atomic_path(final) as tmp:
        # the temporary name is never protected: this call goes straight to pathlib
        return getattr(type(instance)(tmp), wrapped.__name__)(*args, **kwargs)


def apply(module, patcher) -> None:
    import torch

    patcher.wrap(torch, "save", _torch_save)
    patcher.wrap(pathlib.Path, "write_text", _path_write)
    patcher.wrap(pathlib.Path, "write_bytes", _path_write)


PATCH = declare(
    id="atomic-save",
    title="atomic writes into the run's output folder",
    delta="torch.save / Path.write_text straight to the final name (truncated files after a kill) -> temporary file, fsync, rename",
    api="torch.save / pathlib.Path.write_text / pathlib.Path.write_bytes",
    kind=Kind.GUARD,
    depends_on=(),
    vllm=">=0.11.1",
    speculators=SPECULATORS_ALL,
    upstream="not in speculators (0.3.0 - 0.4.x save straight to the final name)",
    remove_when="the stock script saves atomically",
)
