"""Helpers shared by the patch modules (stdlib and wrapt only at import time)."""

from __future__ import annotations

import inspect
from typing import Any

GENERATOR = "speculators.data_generation.vllm_hidden_states_generator"
WORKER = "speculators.data_generation.custom_worker"

#: speculators releases whose generator/worker these patches were written against
SPECULATORS_03 = ">=0.3.0,<0.4"

#: vLLM releases the patch set was validated on (base versions; nightlies of 0.16.x included).
#: 0.11.1 is where the first of the deltas (v2-v5, chunked prefill on by default) appeared;
#: 0.11.0 has none of them, and there the guards and options stay off.
VALIDATED_RANGE = ">=0.11.1,<0.17"


def params(obj: Any) -> dict[str, inspect.Parameter]:
    """The parameters of a callable (a class: its constructor), following wrappers."""
    return dict(inspect.signature(obj).parameters)


#: where the stock generator imports its vLLM names from (read statically by the fast check)
VLLM_CONFIG = "vllm.config"
KV_CACHE_UTILS = "vllm.v1.core.kv_cache_utils"
SCHEDULER = "vllm.v1.core.sched.scheduler"
EXECUTOR = "vllm.v1.executor.multiproc_executor"
REQUEST = "vllm.v1.request"
LLAMA = "vllm.model_executor.models.llama"
ROTARY = "vllm.model_executor.layers.rotary_embedding.base"


def static_params(view, module: str, name: str, method: str | None = None) -> dict[str, inspect.Parameter]:
    """The parameters of ``module.name`` (or its ``method``) read from the installed sources;
    raises ``LookupError`` (an unknown shape) if they cannot be read."""
    what = f"{module}.{name}" + (f".{method}" if method else "")
    return view.require(view.vllm.params(module, name, method), what)


def required(param: inspect.Parameter) -> bool:
    return param.default is inspect.Parameter.empty and param.kind not in (
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.VAR_KEYWORD,
    )


def generator_methods(what: str, methods: tuple[str, ...], found: set[str]) -> "Probe":
    """The probe of a guard or option: the generator class has the methods it wraps."""
    from speculators_compat.registry import Probe

    missing = [m for m in methods if m not in found]
    if missing:
        return Probe.unknown(f"VllmHiddenStatesGenerator has no {', '.join(missing)}")
    return Probe.new(f"{what} around VllmHiddenStatesGenerator.{'/'.join(methods)}")


def generator_patch(what: str, wrappers: dict[str, Any]):
    """``(probe, static_probe, apply)`` of a guard or option that wraps methods of the
    generator class: ``wrappers`` maps each method name to its wrapper, so what the probes
    require is exactly what ``apply`` wraps."""
    probe, static_probe = generator_probes(what, tuple(wrappers))

    def apply(module, patcher) -> None:
        for method, wrapper in wrappers.items():
            patcher.wrap(module.VllmHiddenStatesGenerator, method, wrapper)

    return probe, static_probe, apply


def generator_probes(what: str, methods: tuple[str, ...]):
    """``(probe, static_probe)`` of a guard or option that wraps ``methods`` of the generator."""

    def probe(module) -> "Probe":
        return generator_methods(what, methods, set(vars(module.VllmHiddenStatesGenerator)))

    def static_probe(view) -> "Probe":
        return generator_methods(what, methods, generator_members(view))

    return probe, static_probe


def generate_probes(judge):
    """``(probe, static_probe)`` that pass the source of ``VllmHiddenStatesGenerator.generate``
    (imported, or read from the installed speculators) to ``judge``."""

    def probe(module) -> "Probe":
        return judge(source_of(module.VllmHiddenStatesGenerator.generate))

    def static_probe(view) -> "Probe":
        return judge(generate_source(view))

    return probe, static_probe


def generator_members(view) -> set[str]:
    """The methods of the installed generator class, read from the speculators sources."""
    names = view.speculators.members(GENERATOR, "VllmHiddenStatesGenerator")
    if not names:
        raise LookupError(f"cannot read {GENERATOR}.VllmHiddenStatesGenerator from the installed sources")
    return names


def binds(params: dict[str, inspect.Parameter], names) -> str | None:
    """Why a call passing ``names`` as keywords does not bind to ``params`` (``None``: it binds)."""
    P = inspect.Parameter
    takes_any = any(p.kind is P.VAR_KEYWORD for p in params.values())
    unknown = [n for n in names if not takes_any and (n not in params or params[n].kind is P.POSITIONAL_ONLY)]
    if unknown:
        return f"got an unexpected keyword argument {unknown[0]!r}"
    missing = [n for n, p in params.items() if required(p) and n not in names]
    if missing:
        return f"missing a required argument: {missing[0]!r}"
    return None


def qualname(obj: Any) -> str:
    obj = getattr(obj, "__wrapped__", obj)
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def signature_text(obj: Any) -> str:
    try:
        return f"{qualname(obj)}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return qualname(obj)

#: speculators 0.4.x (vLLM 0.12-0.16), which fixed most API breaks itself
SPECULATORS_04 = ">=0.4.0,<0.5"

#: the library's own guards and options serve every speculators release with the generator
SPECULATORS_ALL = ">=0.3.0,<0.5"


def source_of(obj) -> str:
    """The source text of a function or class (read, never executed)."""
    import inspect

    return inspect.getsource(getattr(obj, "__wrapped__", obj))


def generate_source(view) -> str:
    """The source of the installed ``VllmHiddenStatesGenerator.generate`` (read statically)."""
    src = view.speculators.source(GENERATOR, "VllmHiddenStatesGenerator", "generate")
    if not src:
        raise LookupError(f"cannot read {GENERATOR}.VllmHiddenStatesGenerator.generate from the installed sources")
    return src


def platform_memory() -> tuple[int, int]:
    """``(free, total)`` device memory as vLLM's current platform reports it (CPU: the
    configured KV cache space), in the shape of ``torch.cuda.mem_get_info()``."""
    from vllm.platforms import current_platform

    total = int(current_platform.get_device_total_memory())
    return total, total
