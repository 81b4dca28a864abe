"""Helpers shared by the patch modules (stdlib and wrapt only at import time)."""

from __future__ import annotations

import inspect
from typing import Any

GENERATOR = "speculators.data_generation.vllm_hidden_states_generator"
WORKER = "speculators.data_generation.custom_worker"

#: speculators releases whose generator/worker these patches were written against
SPECULATORS_03 = ">=0.3.0,<0.4"

#: vLLM releases the 0.16 patch set was validated on (base versions; nightlies of 0.16.x included)
VALIDATED_016 = ">=0.12,<0.17"


def params(obj: Any) -> dict[str, inspect.Parameter]:
    """The parameters of a callable (a class: its constructor), following wrappers."""
    return dict(inspect.signature(obj).parameters)


def required(param: inspect.Parameter) -> bool:
    return param.default is inspect.Parameter.empty and param.kind not in (
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.VAR_KEYWORD,
    )


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


def platform_memory() -> tuple[int, int]:
    """``(free, total)`` device memory as vLLM's current platform reports it (CPU: the
    configured KV cache space), in the shape of ``torch.cuda.mem_get_info()``."""
    from vllm.platforms import current_platform

    total = int(current_platform.get_device_total_memory())
    return total, total
