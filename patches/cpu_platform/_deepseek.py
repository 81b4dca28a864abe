"""Whether the stock worker extension can run DeepSeek-architecture models at all: the CPU
patches whose delta only such models reach are not needed where it refuses them (0.11.0)."""

from __future__ import annotations

from speculators_compat.patching import Probe, Shape

from .._probes import off_cpu, off_cpu_static

#: the class the DeepSeek-V2/V3 (and Kimi-K2) architectures run as in vLLM
DEEPSEEK = ("vllm.model_executor.models.deepseek_v2", "DeepseekV2ForCausalLM")
NO_DEEPSEEK = ("the stock worker extension refuses DeepSeek-architecture models, the only ones this delta reaches "
               "(its supports_eagle3 check runs, v3 not needed, and DeepseekV2ForCausalLM has no "
               "set_aux_hidden_state_layers)")


def deepseek_unreachable() -> Probe | None:
    """``Probe.old`` where the stock worker extension refuses DeepSeek-architecture models: its
    own capture setup runs (``v3``'s delta is absent) and vLLM's ``supports_eagle3`` is false
    for them (0.11.0); else ``None``."""
    import importlib

    from vllm.model_executor.models.interfaces import supports_eagle3

    from ..vllm_api import v3

    if v3.probe(None).shape is not Shape.OLD:
        return None
    cls = getattr(importlib.import_module(DEEPSEEK[0]), DEEPSEEK[1])
    return None if supports_eagle3(cls) else Probe.old(NO_DEEPSEEK)


def deepseek_unreachable_static(view) -> Probe | None:
    """:func:`deepseek_unreachable` read from the installed sources (``set_aux_hidden_state_layers``
    defined by the class or a base in vLLM); ``None`` when that cannot be read."""
    from ..vllm_api import v3

    try:
        if v3.static_probe(view).shape is not Shape.OLD:
            return None
    except LookupError:
        return None
    members = view.vllm.members(*DEEPSEEK)
    if not members or "set_aux_hidden_state_layers" in members:
        return None
    return Probe.old(NO_DEEPSEEK)


def cpu_deepseek_gate() -> Probe | None:
    """``Probe.old`` off vLLM's CPU platform or where DeepSeek models never reach the CPU kernel
    (:func:`deepseek_unreachable`); ``None``: the patch's own probe decides."""
    gate = off_cpu()
    return gate if gate is not None else deepseek_unreachable()


def cpu_deepseek_gate_static(view) -> Probe | None:
    """:func:`cpu_deepseek_gate` read from the installed sources."""
    gate = off_cpu_static(view)
    return gate if gate is not None else deepseek_unreachable_static(view)
