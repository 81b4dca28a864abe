"""pipelined-steps -- the driver schedules the next step while the workers run the current one.

Problem (speculators 0.3.x, every vLLM release with two-phase execution): the stock loop sends
a step (``execute_model``, and with ``v5`` ``sample_tokens``), waits for the workers' reply --
which it never reads -- and only then schedules the next step. The accelerator idles while the
driver schedules and while each reply and request cross the message queues: on an H200 the
steps of a 1.2B call took 0.24 s where vLLM's own engine took 0.20 s for the same work.

How: the ``MultiprocExecutor`` name in the generator module is wrapped so the generator's
executor sends ``execute_model`` and ``sample_tokens`` without waiting (``non_block=True``) and
returns ``None`` (what the stock code ignores). At most ``IN_FLIGHT`` replies are left
outstanding (vLLM's message queues hold 10): the oldest is awaited before another step is sent,
and every outstanding reply is awaited -- its error raised -- before any other call reaches the
workers (``collective_rpc``, e.g. the captured states at the end of the call). The workers run
the steps in the order they were sent. A step with no tokens (the finished request ids that
``v5`` sends after the call) is sent the same way: its reply is awaited by the next call's first
message to the workers, so ``generate()`` returns without waiting for it.

On an accelerator the workers also run vLLM's asynchronous scheduling
(``SchedulerConfig(async_scheduling=True)``, which ``v5`` turns off): a worker launches the next
step before the sampled tokens of the current one -- which the stock loop never reads -- have
reached the host. Measured on an H200 (vLLM 0.26.0, 2026-12-02): the same rows bit for bit, the
1.2B Llama's calls 0.32 -> 0.25 s. ``SPECULATORS_COMPAT_ASYNC_STEPS=0`` keeps it off; never on
vLLM's CPU platform.

Detection: ``MultiprocExecutor.execute_model`` and ``sample_tokens`` take ``non_block``, and
vLLM's ``FutureWrapper.result`` takes the replies in the order they were sent (it drains the
futures queued before it); otherwise (or without ``sample_tokens``: no two-phase execution) not
needed, and the steps wait for their replies as stock.

Performance only (same data, less time): left off where no validation run applied it. Remove when
speculators 0.3.x is no longer supported.
"""

from __future__ import annotations

import collections

import wrapt

from speculators_compat.core import _env
from speculators_compat.core.registry import Kind, Patch, Probe, Side

from speculators_compat.core.targets import GENERATOR

from .._probes import params, static_params, vllm_module
from .._ranges import SPECULATORS_03

ASYNC_ENV = _env.ASYNC_STEPS
#: replies left outstanding at most (two steps: execute_model + sample_tokens each)
IN_FLIGHT = 4
METHODS = ("execute_model", "sample_tokens")


#: what ``FutureWrapper.result`` must do for replies to be taken in the order they were sent:
#: drain the futures queued before it (the executor's single reply queue per worker)
IN_ORDER = "futures_queue.pop()"


def _judge(signatures: dict, result_source: str | None) -> Probe:
    if "sample_tokens" not in signatures:
        return Probe.old("MultiprocExecutor has no sample_tokens (no two-phase execution)")
    lacking = [m for m in METHODS if "non_block" not in (signatures.get(m) or {})]
    # without either, the steps wait for their replies, as the stock loop does
    if lacking:
        return Probe.old(f"MultiprocExecutor.{lacking[0]} takes no non_block")
    if not result_source or IN_ORDER not in result_source:
        return Probe.old(f"vLLM's FutureWrapper.result does not drain the futures sent before it ({IN_ORDER!r})")
    return Probe.new("MultiprocExecutor.execute_model/sample_tokens(non_block=True) return futures taken in order")


def probe(module) -> Probe:
    import importlib
    import inspect

    cls = module.MultiprocExecutor
    wrapper = getattr(importlib.import_module(cls.__module__), "FutureWrapper", None)
    try:
        source = inspect.getsource(wrapper.result) if wrapper is not None else None
    except (OSError, TypeError):
        source = None
    return _judge({m: params(getattr(cls, m)) for m in METHODS if hasattr(cls, m)}, source)


def static_probe(view) -> Probe:
    out = {}
    for m in METHODS:
        try:
            out[m] = static_params(view, "MultiprocExecutor", m)
        except LookupError:
            continue
    if "execute_model" not in out:
        raise LookupError("cannot read MultiprocExecutor.execute_model from the installed sources")
    return _judge(out, view.vllm.source(vllm_module(view, "MultiprocExecutor"), "FutureWrapper", "result"))


class PipelinedExecutor(wrapt.ObjectProxy):
    """The generator's view of its executor: steps are sent without waiting for their replies."""

    def __init__(self, wrapped) -> None:
        super().__init__(wrapped)
        self._self_pending: collections.deque = collections.deque()

    def _self_send(self, method: str, arg):
        while len(self._self_pending) >= IN_FLIGHT:
            self._self_pending.popleft().result()
        self._self_pending.append(getattr(self.__wrapped__, method)(arg, non_block=True))

    def wait_steps(self) -> None:
        """Await every step sent (raising the first error)."""
        pending, self._self_pending = self._self_pending, collections.deque()
        error = None
        for future in pending:
            try:
                future.result()
            except Exception as exc:  # every reply must be taken off the queue; the first error is raised
                error = error or exc
        if error is not None:
            raise error

    def execute_model(self, scheduler_output, *args, **kwargs):
        if args or kwargs:
            self.wait_steps()
            return self.__wrapped__.execute_model(scheduler_output, *args, **kwargs)
        self._self_send("execute_model", scheduler_output)
        return None

    def sample_tokens(self, grammar_output, *args, **kwargs):
        if args or kwargs:
            self.wait_steps()
            return self.__wrapped__.sample_tokens(grammar_output, *args, **kwargs)
        self._self_send("sample_tokens", grammar_output)
        return None

    def collective_rpc(self, *args, **kwargs):
        self.wait_steps()
        return self.__wrapped__.collective_rpc(*args, **kwargs)


def _executor(wrapped, instance, args, kwargs):
    return PipelinedExecutor(wrapped(*args, **kwargs))


def _async_steps() -> bool:
    if _env.async_steps_off():
        return False
    from vllm.platforms import current_platform

    return not current_platform.is_cpu()


def _scheduler_config(wrapped, instance, args, kwargs):
    if _async_steps():
        kwargs["async_scheduling"] = True
    return wrapped(*args, **kwargs)


def apply(module, patcher) -> None:
    patcher.wrap(module, "MultiprocExecutor", _executor)
    if "async_scheduling" in params(module.SchedulerConfig):
        patcher.wrap(module, "SchedulerConfig", _scheduler_config)


PATCH = Patch(
    id="pipelined-steps",
    title="the next step is scheduled while the workers run the current one",
    delta="every step waits for a reply the stock loop never reads -> steps sent without waiting",
    api="vllm.v1.executor.multiproc_executor.MultiprocExecutor.execute_model/sample_tokens(non_block=)",
    side=Side.DRIVER,
    kind=Kind.PERFORMANCE,
    # its proxy sits inside v5's two-phase proxy (which calls it) and outside v4's and v7's; it
    # wraps SchedulerConfig outside v1-chunked-prefill's (and inside v5's)
    after=("v7", "v1-chunked-prefill"),
    target=GENERATOR,
    vllm=">=0.11.1",
    speculators=SPECULATORS_03,
    probe=probe,
    static_probe=static_probe,
    apply=apply,
    upstream="not fixed in speculators 0.3.x",
    remove_when="speculators 0.3.x is no longer supported",
)
