"""Helpers for writing probes: where the stock code's vLLM names live, signatures read at runtime
or from the installed sources, the gate of a patch of vLLM's CPU platform, and the probes of a patch
that wraps generator methods."""

from __future__ import annotations

import inspect
from operator import attrgetter
from typing import Any

from speculators_compat.patching import GENERATOR, WORKER, Edit, Probe

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


#: what a patch of vLLM's CPU platform finds on another build, read from the installed distribution
NOT_CPU_BUILD = "not a CPU build of vLLM (from its distribution name and version)"


def off_cpu() -> Probe | None:
    """``Probe.old`` naming vLLM's platform where it is not the CPU, for a patch of the CPU platform
    only; ``None`` on the CPU (the patch's own probe decides)."""
    from vllm.platforms import current_platform

    return None if current_platform.is_cpu() else Probe.old(f"vLLM platform {type(current_platform).__name__}")


def off_cpu_static(view) -> Probe | None:
    """:func:`off_cpu` read from the installed sources: ``Probe.old`` where vLLM is not a CPU build."""
    return None if view.cpu else Probe.old(NOT_CPU_BUILD)


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


def keyword_patch(cls: str, name: str, value: Any, judge, *, callers_choice: bool = False):
    """``(probe, static_probe, apply, calls)`` of a patch that passes ``name=value`` to the stock
    generator's ``cls(...)`` (``callers_choice``: unless the call passes it already). Both probes give
    ``judge`` the parameters of ``cls`` (imported, or read from the installed sources); ``calls``
    declares the keyword added, for the ``stock-calls`` check."""

    def probe(module) -> Probe:
        return judge(params(getattr(module, cls)))

    def static_probe(view) -> Probe:
        return judge(static_params(view, cls))

    def forced(wrapped, instance, args, kwargs):
        if callers_choice:
            kwargs.setdefault(name, value)
        else:
            kwargs[name] = value
        return wrapped(*args, **kwargs)

    def apply(module, patcher) -> None:
        patcher.wrap(module, cls, forced)

    return probe, static_probe, apply, {cls: Edit(add=(name,))}


def wrapping(wrappers: dict[str, Any]):
    """``apply`` of a patch that only wraps names of its target: ``wrappers`` maps each name
    (``"Scheduler"``) or method (``"VllmHiddenStatesGenerator.__init__"``) to its wrapper, wrapped in
    that order. Its ``wraps`` are the names, for the readers of what a patch touches."""

    def apply(module, patcher) -> None:
        for path, wrapper in wrappers.items():
            owner, _, name = path.rpartition(".")
            patcher.wrap(attrgetter(owner)(module) if owner else module, name, wrapper)

    apply.wraps = tuple(wrappers)
    return apply


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


def source_has(func, parts) -> bool:
    """Every one of ``parts`` is in the source of ``func``, whitespace aside (``False`` where the
    source cannot be read)."""
    try:
        flat = " ".join(source_of(func).split())
    except (OSError, TypeError):
        return False
    return all(part in flat for part in parts)


def transformers_version() -> str:
    """The installed transformers version (from its metadata; nothing imported)."""
    from speculators_compat.patching import versions

    found = versions.installed("transformers")
    return str(found.version) if found else "not installed"
