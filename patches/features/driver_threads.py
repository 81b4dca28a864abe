"""driver-threads -- the generator's process keeps its torch threads after the executor starts.

Problem (every vLLM release with ``MultiprocExecutor``): when the executor starts its workers,
vLLM's ``set_multiprocessing_worker_envs()`` sets ``OMP_NUM_THREADS=1`` (unless set) *and*
``torch.set_num_threads(1)`` in the calling process. In vLLM's own engine that process only
schedules. In the stock generator it is the process that slices every call's captured states
into per-sequence tensors (``.clone()`` of every row, GBs per call): single-threaded.
Measured on an H200 host (1 GiB of states per call): 2.5 s of a 6.5 s ``generate()`` with one
thread, 0.5 s with the host's threads.

How: ``VllmHiddenStatesGenerator.__init__`` is wrapped: if ``OMP_NUM_THREADS`` was not set
when it started and torch's thread count dropped during it, the count it had is put back, at
most ``MAX_THREADS`` (8): the slicing is memory-bound, and on a busy host more threads only
spin. Measured on the H200 host (32 cores, another extraction running on the second GPU), the
driver's share of a 1 GiB call: 1 thread 4.8 s, 8 threads 1.9 s, 32 threads 9.5 s. The
workers already started with vLLM's setting; ``OMP_NUM_THREADS`` stays as vLLM set it. A user
who sets ``OMP_NUM_THREADS`` gets exactly that.

Detection: ``vllm.v1.executor.multiproc_executor`` calls ``torch.set_num_threads``: new.
Otherwise not needed.

Performance only (same data, less time); it does not depend on the vLLM release. Remove when
the stock generator no longer post-processes in the executor's parent process.
"""

from __future__ import annotations

import inspect
import logging
import os

from speculators_compat.patching import Kind, Probe, declare

from .._probes import wrapping


EXECUTOR = "vllm.v1.executor.multiproc_executor"
#: the most torch threads put back (see the docstring's measurement)
MAX_THREADS = 8
CALL = "torch.set_num_threads("


def _judge(text: str | None) -> Probe:
    if text is None:
        return Probe.unknown(f"cannot read {EXECUTOR}")
    if CALL not in text:
        return Probe.old(f"{EXECUTOR} leaves the parent's torch threads alone")
    return Probe.new(f"{EXECUTOR} sets the parent process's torch threads to 1 when it starts workers")


def probe(module) -> Probe:
    import importlib

    try:
        return _judge(inspect.getsource(importlib.import_module(EXECUTOR)))
    except (ImportError, OSError, TypeError):
        return _judge(None)


def static_probe(view) -> Probe:
    return _judge(view.vllm.text(EXECUTOR) or None)


def _init(wrapped, instance, args, kwargs):
    import torch

    before = torch.get_num_threads()
    user_set = "OMP_NUM_THREADS" in os.environ
    try:
        return wrapped(*args, **kwargs)
    finally:
        now = torch.get_num_threads()
        want = min(before, MAX_THREADS)
        if not user_set and now < want:
            torch.set_num_threads(want)
            logging.getLogger("speculators_compat").debug(
                "driver-threads: torch threads %d -> %d in the generator's process", now, want)


apply = wrapping({"VllmHiddenStatesGenerator.__init__": _init})


PATCH = declare(
    title="the generator's process keeps its torch threads",
    delta="starting the executor sets the parent's torch threads to 1 -> restored after it started",
    api="vllm.v1.executor.multiproc_executor.set_multiprocessing_worker_envs",
    kind=Kind.PERFORMANCE,
    depends_on=(),
    after=("dtype",),  # wraps __init__ outside it
    upstream="vLLM does this on purpose for its engine process",
    remove_when="the stock generator no longer post-processes in the executor's parent process",
)
