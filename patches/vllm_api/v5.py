"""v5 -- two-phase execution, and workers that learn which requests finished.

Delta (vLLM 0.11.1): ``Executor.execute_model(scheduler_output)`` returns ``None`` for
every generative step and parks the step's state in the worker; ``sample_tokens(
grammar_output)`` must follow. Stock speculators 0.3.0 never calls it, so the *second*
``generate()`` fails with "State error: sample_tokens() must be called after
execute_model() returns None" (a one-call test hides it).

Also fixed here (every release): the stock loop stops at the first scheduler output with
no tokens, which is the one carrying ``finished_req_ids``; it is never sent, so each
worker's ``model_runner.requests`` grows by the batch size on every call.

Async scheduling (vLLM 0.14+, on by default on CUDA) is turned off through
``SchedulerConfig(async_scheduling=False)``: the generator drives the synchronous
``Scheduler`` by hand and reads results step by step.

How: the ``MultiprocExecutor`` name in the generator module is wrapped so the generator's
executor proxy calls ``sample_tokens(None)`` whenever ``execute_model`` returned ``None``
for a step with tokens; the ``Scheduler`` name is wrapped to remember the last idle output
that carries finished request ids, and ``generate`` is wrapped to send it to the workers
once the stock loop is done. ``SchedulerConfig`` gets ``async_scheduling=False`` where the
field exists.

Detection: ``MultiprocExecutor.sample_tokens`` exists (new) or not (old).

Remove when speculators 0.3.x is no longer supported.
"""

from __future__ import annotations

import wrapt

from speculators_compat.patching import Probe, declare

from .._idle_output import call_then_flush, flush_finished, remember_idle
from .._probes import params, vllm_module


def _judge(has_sample_tokens: bool) -> Probe:
    if has_sample_tokens:
        return Probe.new("MultiprocExecutor.sample_tokens exists")
    return Probe.old("MultiprocExecutor has no sample_tokens")


def probe(module) -> Probe:
    return _judge(hasattr(module.MultiprocExecutor, "sample_tokens"))


def static_probe(view) -> Probe:
    module = vllm_module(view, "MultiprocExecutor")
    if not view.vllm.mro(module, "MultiprocExecutor"):
        raise LookupError(f"cannot read {module}.MultiprocExecutor from the installed sources")
    return _judge("sample_tokens" in view.vllm.members(module, "MultiprocExecutor"))


class TwoPhaseExecutor(wrapt.ObjectProxy):
    """The generator's view of its executor: one ``execute_model`` call runs a whole step."""

    def execute_model(self, scheduler_output, *args, **kwargs):
        out = self.__wrapped__.execute_model(scheduler_output, *args, **kwargs)
        if out is None and scheduler_output.total_num_scheduled_tokens > 0:
            out = self.__wrapped__.sample_tokens(None)
        return out


def _executor(wrapped, instance, args, kwargs):
    return TwoPhaseExecutor(wrapped(*args, **kwargs))


def _remember_idle(wrapped, instance, args, kwargs):
    return remember_idle(wrapped.__self__, wrapped(*args, **kwargs))


def _scheduler(wrapped, instance, args, kwargs):
    scheduler = wrapped(*args, **kwargs)
    scheduler.schedule = wrapt.FunctionWrapper(scheduler.schedule, _remember_idle)
    return scheduler


def _scheduler_config(wrapped, instance, args, kwargs):
    kwargs.setdefault("async_scheduling", False)
    return wrapped(*args, **kwargs)


def _generate(wrapped, instance, args, kwargs):
    return call_then_flush(wrapped, args, kwargs, lambda: flush_finished(instance))


def apply(module, patcher) -> None:
    patcher.wrap(module, "MultiprocExecutor", _executor)
    patcher.wrap(module, "Scheduler", _scheduler)
    if "async_scheduling" in params(module.SchedulerConfig):
        patcher.wrap(module, "SchedulerConfig", _scheduler_config)
    patcher.wrap(module.VllmHiddenStatesGenerator, "generate", _generate)


PATCH = declare(
    title="sample_tokens after execute_model (vLLM 0.11.1); finished requests reach the workers",
    delta="execute_model() -> None + sample_tokens(); finished_req_ids never reach workers",
    api="vllm.v1.executor.multiproc_executor.MultiprocExecutor.execute_model/sample_tokens",
    after=("v1-chunked-prefill", "v2", "v7", "pipelined-steps"),  # wraps SchedulerConfig, Scheduler and MultiprocExecutor outside them
    upstream="speculators 0.4.0 calls sample_tokens (but still never calls update_from_output)",
)
