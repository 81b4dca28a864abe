"""spawn-workers -- on a GPU, the generator's vLLM workers are spawned, not forked.

Problem (CUDA builds): ``MultiprocExecutor`` forks its workers unless it sees CUDA initialised in
the driver. A driver process in which CUDA was touched without torch marking it initialised
(a device-count query poisons ``fork`` in torch, yet ``torch.cuda.is_initialized()`` stays
false) gets workers that die at ``init_device`` with "Cannot re-initialize CUDA in forked
subprocess". Measured on an H200 (vLLM 0.26.0, 2026-12-03): the stock generator in a fresh
process -- speculators' data script through ``speculators-compat run``, a bare script -- failed
so at start with fork, and ran (50 calls, 800 samples saved) with ``spawn``.

How: ``VllmHiddenStatesGenerator.__init__`` is wrapped; where ``VLLM_WORKER_MULTIPROC_METHOD`` is
not set, it is ``spawn`` while the executor starts (vLLM's own choice once CUDA is initialised,
and the method the GPU validation runs used). The workers get the patches through the
``vllm.general_plugins`` entry point, as they do at TP > 1. A value the user set is kept.

Detection: a vLLM platform other than the CPU (static: not a CPU build): new; the CPU platform
(forked workers never touch CUDA): not needed. It does not depend on the vLLM release.

Remove when vLLM spawns GPU workers by default.
"""

from __future__ import annotations

import os

from speculators_compat.patching import Kind, Probe, declare

from .._probes import wrapping
from .._ranges import SPECULATORS_ALL

VAR = "VLLM_WORKER_MULTIPROC_METHOD"


def probe(module) -> Probe:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return Probe.old("the CPU platform: forked workers do not touch CUDA")
    return Probe.new(f"vLLM platform {type(current_platform).__name__}: workers forked from the driver")


def static_probe(view) -> Probe:
    if view.cpu:
        return Probe.old("a CPU build of vLLM: forked workers do not touch CUDA")
    return Probe.new("not a CPU build of vLLM: workers would be forked from the driver")


def _init(wrapped, instance, args, kwargs):
    if os.environ.get(VAR):
        return wrapped(*args, **kwargs)
    os.environ[VAR] = "spawn"
    try:
        return wrapped(*args, **kwargs)
    finally:
        os.environ.pop(VAR, None)


apply = wrapping({"VllmHiddenStatesGenerator.__init__": _init})


PATCH = declare(
    title="GPU workers spawned, not forked (no 'Cannot re-initialize CUDA in forked subprocess')",
    delta="MultiprocExecutor forks the workers of a driver that touched CUDA -> they are spawned",
    api="VLLM_WORKER_MULTIPROC_METHOD / vllm.v1.executor.multiproc_executor.MultiprocExecutor",
    kind=Kind.FIX,
    depends_on=(),  # the start method vLLM itself switches to; the same on every release
    speculators=SPECULATORS_ALL,
    upstream="-",
    remove_when="vLLM spawns GPU workers by default",
)
