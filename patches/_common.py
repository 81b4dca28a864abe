"""Helpers shared by the patch modules (stdlib, wrapt and the engine only at import time).

Patch modules never import each other: what two patches share lives here.
"""

from __future__ import annotations

import inspect
import logging
import threading
import weakref
from typing import Any

from speculators_compat.registry import Probe
from speculators_compat.targets import GENERATOR, WORKER

#: imported by ``speculators/__init__.py`` before it rebuilds its pydantic schemas and
#: auto-imports ``speculators.models``
SPECULATORS_CONFIG = "speculators.config"
#: imported by ``speculators.config`` before it defines its pydantic config classes
SPECULATORS_UTILS = "speculators.utils"

#: speculators releases whose generator/worker the patches were written against
SPECULATORS_03 = ">=0.3.0,<0.4"
#: speculators 0.4.x (vLLM 0.12-0.16), which fixed most API breaks itself
SPECULATORS_04 = ">=0.4.0,<0.5"
#: the library's own guards and options serve every speculators release with the generator
SPECULATORS_ALL = ">=0.3.0,<0.5"
#: what the guards and options are written for: vLLM 0.11.1 brought the two-phase execution
#: and the other deltas; on 0.11.0 (what speculators 0.3.0 was written for) nothing of ours
#: wraps the stock code
SINCE_TWO_PHASE = ">=0.11.1"

#: where vLLM defines names the stock code does not import itself (the others are found through
#: the stock generator's and worker's own ``from vllm... import`` lines)
ELSEWHERE = {
    "LlamaModel": "vllm.model_executor.models.llama",
    "RotaryEmbedding": "vllm.model_executor.layers.rotary_embedding.base",
}
#: where speculators 0.3.0 imports them from (used when the speculators sources cannot be read)
STOCK_IMPORTS = {
    "CacheConfig": "vllm.config",
    "ModelConfig": "vllm.config",
    "SchedulerConfig": "vllm.config",
    "get_kv_cache_config_from_groups": "vllm.v1.core.kv_cache_utils",
    "Scheduler": "vllm.v1.core.sched.scheduler",
    "MultiprocExecutor": "vllm.v1.executor.multiproc_executor",
    "Request": "vllm.v1.request",
}


def params(obj: Any) -> dict[str, inspect.Parameter]:
    """The parameters of a callable (a class: its constructor), following wrappers."""
    return dict(inspect.signature(obj).parameters)


def vllm_module(view, name: str) -> str:
    """The vLLM module a name is read from: where the installed stock code imports it."""
    if name in ELSEWHERE:
        return ELSEWHERE[name]
    for target in (GENERATOR, WORKER):
        for module, imported in view.speculators.imports(target, "vllm"):
            if imported == name:
                return module
    return STOCK_IMPORTS[name]


def static_params(view, name: str, method: str | None = None) -> dict[str, inspect.Parameter]:
    """The parameters of the vLLM ``name`` (or its ``method``) read from the installed sources;
    raises ``LookupError`` (an unknown shape) if they cannot be read."""
    module = vllm_module(view, name)
    what = f"{module}.{name}" + (f".{method}" if method else "")
    return view.require(view.vllm.params(module, name, method), what)


def required(param: inspect.Parameter) -> bool:
    return param.default is inspect.Parameter.empty and param.kind not in (
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.VAR_KEYWORD,
    )


def binds(params: dict[str, inspect.Parameter], names, positional: int = 0) -> str | None:
    """Why a call passing ``positional`` arguments and ``names`` as keywords does not bind to
    ``params`` (``None``: it binds)."""
    P = inspect.Parameter
    ordered = [p for p in params.values() if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    takes_varargs = any(p.kind is P.VAR_POSITIONAL for p in params.values())
    if positional > len(ordered) and not takes_varargs:
        return f"takes {len(ordered)} positional arguments but {positional} were given"
    filled = {p.name for p in ordered[:positional]}
    takes_any = any(p.kind is P.VAR_KEYWORD for p in params.values())
    unknown = [n for n in names if not takes_any and (n not in params or params[n].kind is P.POSITIONAL_ONLY)]
    if unknown:
        return f"got an unexpected keyword argument {unknown[0]!r}"
    twice = [n for n in names if n in filled]
    if twice:
        return f"got multiple values for argument {twice[0]!r}"
    missing = [n for n, p in params.items() if required(p) and n not in names and n not in filled]
    if missing:
        return f"missing a required argument: {missing[0]!r}"
    return None


def generator_methods(what: str, methods: tuple[str, ...], found: set[str]) -> Probe:
    """The probe of a guard or option: the generator class has the methods it wraps."""
    missing = [m for m in methods if m not in found]
    if missing:
        return Probe.unknown(f"VllmHiddenStatesGenerator has no {', '.join(missing)}")
    return Probe.new(f"{what} around VllmHiddenStatesGenerator.{'/'.join(methods)}")


def generator_patch(what: str, wrappers: dict[str, Any]):
    """``(probe, static_probe, apply)`` of a guard or option that wraps methods of the
    generator class: ``wrappers`` maps each method name to its wrapper, so what the probes
    require is exactly what ``apply`` wraps."""
    methods = tuple(wrappers)

    def probe(module) -> Probe:
        return generator_methods(what, methods, set(vars(module.VllmHiddenStatesGenerator)))

    def static_probe(view) -> Probe:
        return generator_methods(what, methods, generator_members(view))

    def apply(module, patcher) -> None:
        for method, wrapper in wrappers.items():
            patcher.wrap(module.VllmHiddenStatesGenerator, method, wrapper)

    return probe, static_probe, apply


def generate_probes(judge, method: str = "generate"):
    """``(probe, static_probe)`` that pass the source of ``VllmHiddenStatesGenerator.<method>``
    (imported, or read from the installed speculators) to ``judge``."""

    def probe(module) -> Probe:
        return judge(source_of(getattr(module.VllmHiddenStatesGenerator, method)))

    def static_probe(view) -> Probe:
        src = view.speculators.source(GENERATOR, "VllmHiddenStatesGenerator", method)
        if not src:
            raise LookupError(f"cannot read {GENERATOR}.VllmHiddenStatesGenerator.{method} from the installed sources")
        return judge(src)

    return probe, static_probe


def generator_members(view) -> set[str]:
    """The methods of the installed generator class, read from the speculators sources."""
    names = view.speculators.members(GENERATOR, "VllmHiddenStatesGenerator")
    if not names:
        raise LookupError(f"cannot read {GENERATOR}.VllmHiddenStatesGenerator from the installed sources")
    return names


def source_of(obj) -> str:
    """The source text of a function or class (read, never executed)."""
    return inspect.getsource(getattr(obj, "__wrapped__", obj))


def transformers_version() -> str:
    """The installed transformers version (from its metadata; nothing imported)."""
    from speculators_compat import versions

    found = versions.installed("transformers")
    return str(found.version) if found else "not installed"


#: per worker-extension instance: the side CUDA stream offload-captured queued its copies on
OFFLOAD_STREAM = "_speculators_compat_offload_stream"


def wait_offload(holder: dict) -> None:
    """Wait for every copy offload-captured queued (one synchronisation per call); ``holder``
    is the extension's ``__dict__``."""
    stream = holder.get(OFFLOAD_STREAM)
    if stream is not None:
        stream.synchronize()


def platform_memory() -> tuple[int, int]:
    """``(free, total)`` device memory as vLLM's current platform reports it (CPU: the
    configured KV cache space), in the shape of ``torch.cuda.mem_get_info()``."""
    from vllm.platforms import current_platform

    total = int(current_platform.get_device_total_memory())
    return total, total


# -- the scheduler's last idle output: shared by v5 (speculators 0.3) and s04-scheduler-loop ----

#: attribute on the scheduler holding the last idle output that carries finished request ids
PENDING = "_speculators_compat_idle_output"


def remember_idle(scheduler, out):
    """Keep an output with no tokens but finished request ids: the stock loop stops on it unsent."""
    if out.total_num_scheduled_tokens == 0 and out.finished_req_ids:
        setattr(scheduler, PENDING, out)
    return out


def flush_finished(generator) -> None:
    """Send the scheduler's last idle output (finished request ids) to the workers."""
    pending = generator.scheduler.__dict__.pop(PENDING, None)
    if pending is not None:
        generator.executor.execute_model(pending)


def call_then_flush(wrapped, args, kwargs, flush) -> Any:
    """``generate()`` then ``flush()``: after a normal return, and after an error (so the
    generator stays usable; an error of the flush itself is logged, the call's own error is what
    the caller gets). Not after Ctrl-C / SIGTERM (``KeyboardInterrupt`` and other non-``Exception``
    exits): a worker that got the same signal may be gone, and the flush's error would replace
    the interrupt that ``speculators-compat run`` turns into exit code 130 / 143."""
    try:
        results = wrapped(*args, **kwargs)
    except Exception:
        try:
            flush()
        except Exception as flush_error:
            logging.getLogger("speculators_compat").debug("flush after a failed generate(): %s", flush_error)
        raise
    flush()
    return results


def forget_idle(scheduler) -> None:
    scheduler.__dict__.pop(PENDING, None)


# -- the first vLLM worker to die: recorded by worker-death, named by worker-death and report ----

#: real executor -> the worker handles whose processes exited first (in the order seen)
_FIRST_EXITS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_exits_lock = threading.Lock()


def real_executor(executor):
    """The executor behind any wrapper proxies (``v4`` wraps the generator's executor)."""
    while hasattr(executor, "__wrapped__"):
        executor = executor.__wrapped__
    return executor


def watch_workers(executor) -> None:
    """Record the first worker(s) of ``executor`` to exit, from a daemon thread: before vLLM's
    worker monitor stops the others, after which every worker is dead and the culprit can no
    longer be told apart."""
    real = real_executor(executor)
    workers = list(getattr(real, "workers", None) or ())
    if not workers:
        return
    with _exits_lock:
        _FIRST_EXITS[real] = []

    def wait() -> None:
        import multiprocessing.connection

        by_sentinel = {w.proc.sentinel: w for w in workers}
        try:
            ready = multiprocessing.connection.wait(list(by_sentinel))
        except OSError:  # the sentinels were closed: the executor is gone
            return
        with _exits_lock:
            exits = _FIRST_EXITS.get(real)
            if exits is not None and not exits:
                exits.extend(by_sentinel[s] for s in ready)

    threading.Thread(target=wait, daemon=True, name="speculators-compat-worker-watch").start()


def _how(code) -> str:
    import signal

    if code is None:
        return "exited"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        extra = " (if nobody sent it, the kernel's OOM killer may have: see dmesg)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{extra}"
    return f"exited with code {code}"


def dead_workers(executor) -> str | None:
    """Which worker died, if the executor failed because one did; else ``None``."""
    real = real_executor(executor)
    workers = list(getattr(real, "workers", None) or ())
    if not getattr(real, "is_failed", False) or not workers:
        return None
    with _exits_lock:
        first = list(_FIRST_EXITS.get(real) or ())
    dead = first or [w for w in workers if w.proc.exitcode is not None]
    if not dead:
        return "a vLLM worker process died"
    parts = []
    for w in dead:
        w.proc.join(timeout=1)  # reaped by now; join only settles exitcode
        parts.append(f"vLLM worker {w.proc.name} (pid {w.proc.pid}, rank {w.rank} of {len(workers)}) {_how(w.proc.exitcode)}")
    return "; ".join(parts)
