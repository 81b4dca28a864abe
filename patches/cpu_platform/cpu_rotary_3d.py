"""cpu-rotary-3d -- vLLM's CPU rotary kernel mis-rotates a 3-D query (DeepSeek on CPU).

Problem (vLLM CPU platform, 0.16.0): ``RotaryEmbedding.forward_cpu`` hands the query and
key to ``ops.rotary_embedding``, whose CPU kernel assumes a 2-D ``[tokens, heads *
head_size]`` layout. DeepSeek-V2/V3's non-MLA attention path (the one vLLM uses on CPU,
``VLLM_MLA_DISABLE=1``; MLA has no CPU backend) passes 3-D ``[tokens, heads, rope_dim]``
views, so every head but the first is rotated with the wrong position: ~23% relative
error, batch-dependent, no error raised. This is a vLLM CPU bug, not a speculators one; it
is patched here so extraction on CPU (the demo, the tests) is correct.

How: ``RotaryEmbedding.forward_cpu`` is wrapped; when the query or key is 3-D it runs the
module's own pure-PyTorch ``forward_native`` (which handles that layout), otherwise the
kernel as before. Subclasses that define their own ``forward_cpu`` are untouched.

Detection: vLLM's current platform is the CPU and ``RotaryEmbedding.forward_cpu`` calls the
``ops.rotary_embedding`` kernel (0.14 and later), or is ``CustomOp.forward_cpu`` running
``forward_cuda``, which calls it (0.11.x - 0.13.x: every custom op runs its CUDA path on the
CPU there; measured on 0.13.0: the kernel mis-rotates 3-D views by up to ~7); on other
platforms, if the kernel call is gone, or where the stock worker extension refuses
DeepSeek-architecture models itself (0.11.0: ``v3`` not needed, and ``supports_eagle3`` false
for ``DeepseekV2ForCausalLM``), not needed. Applied in the worker processes only (they run the
model), and only where the speculators worker extension is imported.

Remove when vLLM's CPU rotary kernel handles 3-D queries (or the non-MLA DeepSeek path
flattens them).
"""

from __future__ import annotations

import inspect

from speculators_compat.patching import Probe, declare

from .._probes import vllm_module
from ._deepseek import cpu_deepseek_gate, cpu_deepseek_gate_static


def _rotary():
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    return RotaryEmbedding


def probe(module) -> Probe:
    gate = cpu_deepseek_gate()
    if gate is not None:
        return gate
    rotary = _rotary()
    return _judge(inspect.getsource(rotary.forward_cpu), inspect.getsource(rotary.forward_cuda))


def static_probe(view) -> Probe:
    gate = cpu_deepseek_gate_static(view)
    if gate is not None:
        return gate
    module = vllm_module(view, "RotaryEmbedding")
    sources = [view.vllm.source(module, "RotaryEmbedding", m) for m in ("forward_cpu", "forward_cuda")]
    if not sources[0]:
        raise LookupError(f"cannot read {module}.RotaryEmbedding.forward_cpu from the installed sources")
    return _judge(*sources)


def _judge(forward_cpu: str, forward_cuda: str) -> Probe:
    if "ops.rotary_embedding" in forward_cpu:
        return Probe.new("CPU platform; RotaryEmbedding.forward_cpu calls the ops.rotary_embedding kernel")
    if "self.forward_cuda(" in forward_cpu and "ops.rotary_embedding" in forward_cuda:
        # 0.11-0.13: CustomOp.forward_cpu runs forward_cuda, which calls the same kernel
        return Probe.new(
            "CPU platform; RotaryEmbedding.forward_cpu runs forward_cuda, which calls the ops.rotary_embedding kernel"
        )
    return Probe.old("RotaryEmbedding.forward_cpu does not reach the ops.rotary_embedding kernel")


def _forward_cpu(wrapped, instance, args, kwargs):
    positions, query, *rest = args
    key = rest[0] if rest else kwargs.get("key")
    if query.dim() == 3 or (key is not None and key.dim() == 3):
        return instance.forward_native(*args, **kwargs)
    return wrapped(*args, **kwargs)


def apply(module, patcher) -> None:
    patcher.wrap(_rotary(), "forward_cpu", _forward_cpu)


PATCH = declare(
    title="CPU rotary kernel with 3-D queries",
    delta="ops.rotary_embedding on CPU assumes [tokens, heads*dim]; DeepSeek non-MLA passes [tokens, heads, dim]",
    api="vllm.model_executor.layers.rotary_embedding.base.RotaryEmbedding.forward_cpu",
    vllm=">=0.11.1",
    upstream="vLLM CPU backend (not fixed as of 0.16)",
    remove_when="vLLM's CPU rotary kernel handles 3-D query/key",
)
