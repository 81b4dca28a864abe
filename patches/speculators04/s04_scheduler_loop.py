"""s04-scheduler-loop -- speculators 0.4's loop captures only the first ``max_num_seqs``.

Problem: speculators 0.4.0/0.4.0.1 drives the scheduler without ever calling
``scheduler.update_from_output`` and aborts its requests only after the loop. Once the first
``max_num_seqs`` (32) requests are prefilled they keep their slots (with no sampled token
they have nothing to schedule), the waiting requests never get one, ``schedule()`` returns no
tokens and the loop ends: ``RuntimeError: Request req_1_32 not found in captured states``.
Its final abort is never sent to the workers either, so their request cache grows per call.

How: the ``Scheduler`` name in the generator module is wrapped; on the instance it builds,
``schedule()`` first aborts every request whose prompt is fully computed (as speculators
0.3.x did after each step), freeing its slot; vLLM then tells the workers in that very
output. ``generate`` is wrapped to send the last abort to the workers after the loop.

Detection: the source of ``generate`` has the 0.4 loop (``all_prefill_complete``) and no
``update_from_output``.

Remove when speculators 0.4.x is no longer supported.
"""

from __future__ import annotations

import wrapt

from speculators_compat.patching import Probe, declare

from .._idle_output import call_then_flush, flush_finished, remember_idle
from .._probes import generate_probes, wrapping


def _judge(src: str) -> Probe:
    if "update_from_output" in src:
        return Probe.old("generate() calls scheduler.update_from_output")
    if "all_prefill_complete" in src:
        return Probe.new("generate() loops on all_prefill_complete without update_from_output")
    return Probe.unknown("generate() has neither the 0.4 loop nor update_from_output")


probe, static_probe = generate_probes(_judge)


def _free_prefilled(wrapped, instance, args, kwargs):
    from vllm.v1.request import RequestStatus

    scheduler = wrapped.__self__
    done = [
        rid
        for rid, req in scheduler.requests.items()
        if not req.is_finished() and req.num_computed_tokens >= req.num_prompt_tokens
    ]
    if done:
        scheduler.finish_requests(done, RequestStatus.FINISHED_ABORTED)
    return remember_idle(scheduler, wrapped(*args, **kwargs))


def _scheduler(wrapped, instance, args, kwargs):
    scheduler = wrapped(*args, **kwargs)
    scheduler.schedule = wrapt.FunctionWrapper(scheduler.schedule, _free_prefilled)
    return scheduler


def _generate(wrapped, instance, args, kwargs):
    def flush():
        if instance.scheduler.finished_req_ids:  # aborted after the loop: not sent yet
            instance.scheduler.schedule()
        flush_finished(instance)

    return call_then_flush(wrapped, args, kwargs, flush)


apply = wrapping({"Scheduler": _scheduler, "VllmHiddenStatesGenerator.generate": _generate})


PATCH = declare(
    title="free prefilled slots (speculators 0.4)",
    delta="loop without update_from_output keeps prefilled requests in their slots -> only max_num_seqs captured",
    api="speculators VllmHiddenStatesGenerator.generate (0.4.x) / vllm Scheduler.schedule",
    after=("v5",),  # wraps Scheduler and generate outside v5 (never both: speculators 0.3 / 0.4)
)
