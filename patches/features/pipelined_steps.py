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

The first step goes early: the stock code builds and adds every request of the call before it
schedules the first step (on an H200 host, 10-17 ms from the call to its first step for 64 prompts
of 1,024 tokens). Once the requests added so far fill a step -- their tokens reach the
scheduler's token budget, or their count passes its sequence limit -- the generator's scheduler
(seen through :class:`FirstStepScheduler` for the call) resets the capture, schedules that step,
sends it and aborts its requests, exactly as the stock loop would, and the stock code goes on
adding the rest while the workers run it; the stock loop's own ``_reset_capture`` is then not
sent again. The step is the one the stock loop would
have scheduled: each step holds whole prompts in the order they were added (``v1-chunked-prefill``
and ``v1-prefix-caching`` turn chunked prefill and prefix caching off; with either on, the first
step waits for every request, as stock), and the scheduler fills a step from the front of its
queue and stops at the first prompt that does not fit, so prompts added later cannot change it.

On an accelerator the workers also run vLLM's asynchronous scheduling
(``SchedulerConfig(async_scheduling=True)``, which ``v5`` turns off): a worker launches the next
step before the sampled tokens of the current one -- which the stock loop never reads -- have
reached the host. Measured on an H200 (vLLM 0.26.0, 2026-12-02): the same rows bit for bit, the
1.2B Llama's calls 0.32 -> 0.25 s. ``SPECULATORS_COMPAT_ASYNC_STEPS=0`` keeps it off; never on
vLLM's CPU platform.

Detection: ``MultiprocExecutor.execute_model`` and ``sample_tokens`` take ``non_block``, and
vLLM's ``FutureWrapper.result`` takes the replies in the order they were sent (it drains the
futures queued before it); otherwise (or without ``sample_tokens``: no two-phase execution) not
needed, and the steps wait for their replies as stock. The first step goes early where the stock
``generate`` has the loop in :data:`STOCK_LOOP` (speculators 0.3.x).

Performance only (same data, less time): left off where no validation run applied it. Remove when
speculators 0.3.x is no longer supported.
"""

from __future__ import annotations

import collections
import logging

import wrapt

from speculators_compat.patching import Kind, Option, Probe, declare


from .._probes import params, source_has, static_params, vllm_module
from .._ranges import SPECULATORS_03

log = logging.getLogger("speculators_compat")

ASYNC_STEPS = Option("SPECULATORS_COMPAT_ASYNC_STEPS", "``0``: steps are not pipelined on an accelerator")
#: replies left outstanding at most (two steps: execute_model + sample_tokens each)
IN_FLIGHT = 4
METHODS = ("execute_model", "sample_tokens")


#: what ``FutureWrapper.result`` must do for replies to be taken in the order they were sent:
#: drain the futures queued before it (the executor's single reply queue per worker)
IN_ORDER = "futures_queue.pop()"

#: the stock loop (speculators 0.3.x) whose first step is sent ahead: every request added, the
#: capture reset, then each step scheduled, sent, and its requests aborted (whitespace-insensitive)
STOCK_LOOP = (
    "self.scheduler.add_request(req)",
    'self._request_counter += 1 self.executor.collective_rpc("_reset_capture")',
    "while ( scheduler_output := self.scheduler.schedule() ).total_num_scheduled_tokens > 0:",
    "self.executor.execute_model(scheduler_output) for req_id in scheduler_output.num_scheduled_tokens: "
    "self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)",
)
#: the stock method the early first step sends itself
RESET = "_reset_capture"
#: attribute of the generator counting its calls whose first step went early
EARLY_ATTR = "_speculators_compat_early_first_steps"


def early_first_steps(generator) -> int:
    """How many of ``generator``'s calls sent their first step early (0 where none did)."""
    return generator.__dict__.get(EARLY_ATTR, 0)


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
        #: the reply of the ``_reset_capture`` an early first step sent (the stock one is then not sent)
        self._self_reset_sent: list | None = None

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

    def reset_sent(self, reply) -> None:
        """An early first step sent ``_reset_capture`` (its ``reply``): the stock loop's own is then
        answered with it, not sent again. ``None``: the next one is sent, as asked."""
        self._self_reset_sent = reply

    def collective_rpc(self, method, *args, **kwargs):
        if method == RESET and self._self_reset_sent is not None and not args and not kwargs:
            reply, self._self_reset_sent = self._self_reset_sent, None
            return reply  # the early first step sent it, before that step
        self.wait_steps()
        return self.__wrapped__.collective_rpc(method, *args, **kwargs)


class FirstStepScheduler(wrapt.ObjectProxy):
    """The generator's scheduler for one call: once the requests added fill a step, that step is
    scheduled and sent (as the stock loop would send it) while the stock code adds the rest."""

    def __init__(self, scheduler, generator, pipelined: PipelinedExecutor, budget: int, max_seqs: int) -> None:
        super().__init__(scheduler)
        self._self_generator, self._self_pipelined = generator, pipelined
        self._self_budget, self._self_max_seqs = budget, max_seqs
        self._self_tokens = self._self_count = 0
        self._self_sent = False

    def add_request(self, request, *args, **kwargs):
        out = self.__wrapped__.add_request(request, *args, **kwargs)
        if not self._self_sent:
            self._self_tokens += request.num_prompt_tokens
            self._self_count += 1
            if self._self_tokens >= self._self_budget or self._self_count > self._self_max_seqs:
                self._self_send_first()
        return out

    def _self_send_first(self) -> None:
        from vllm.v1.request import RequestStatus

        self._self_sent = True
        generator = self._self_generator
        generator.__dict__[EARLY_ATTR] = early_first_steps(generator) + 1
        executor, scheduler = generator.executor, self.__wrapped__
        self._self_pipelined.reset_sent(executor.collective_rpc(RESET))
        out = scheduler.schedule()
        if out.total_num_scheduled_tokens > 0:
            executor.execute_model(out)
            for req_id in out.num_scheduled_tokens:
                scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)


def _pipelined(executor) -> PipelinedExecutor | None:
    """The :class:`PipelinedExecutor` inside the generator's executor views, if any."""
    while executor is not None:
        if isinstance(executor, PipelinedExecutor):
            return executor
        executor = getattr(executor, "__wrapped__", None)
    return None


def stock_loop(generate) -> bool:
    """The stock ``generate`` runs :data:`STOCK_LOOP`."""
    return source_has(generate, STOCK_LOOP)


def _first_step(generator):
    """The call's :class:`FirstStepScheduler`, or ``None`` where the first step cannot go early."""
    scheduler, config = generator.scheduler, generator.vllm_config
    pipelined = _pipelined(generator.executor)
    budget = getattr(scheduler, "max_num_scheduled_tokens", None)
    # the scheduler admits at most this many requests to a step (0.32: and at most max_num_active_reqs)
    limits = [getattr(scheduler, a, None) for a in ("max_num_running_reqs", "max_num_active_reqs")]
    max_seqs = min((n for n in limits if isinstance(n, int)), default=None)
    whole_prompts = (getattr(config.scheduler_config, "enable_chunked_prefill", None) is False
                     and not getattr(config.cache_config, "enable_prefix_caching", None))
    if pipelined is None or not whole_prompts or not isinstance(budget, int) or not isinstance(max_seqs, int):
        return None
    return FirstStepScheduler(scheduler, generator, pipelined, budget, max_seqs)


def _generate(wrapped, instance, args, kwargs):
    scheduler = instance.__dict__.get("scheduler")
    early = _first_step(instance) if scheduler is not None else None
    if early is None:
        return wrapped(*args, **kwargs)
    instance.scheduler = early
    try:
        return wrapped(*args, **kwargs)
    finally:
        instance.scheduler = scheduler
        early._self_pipelined.reset_sent(None)  # never carried into another call


def _executor(wrapped, instance, args, kwargs):
    return PipelinedExecutor(wrapped(*args, **kwargs))


def _async_steps() -> bool:
    if ASYNC_STEPS.raw() == "0":  # the user keeps steps unpipelined
        return False
    from vllm.platforms import current_platform

    return not current_platform.is_cpu()


def _scheduler_config(wrapped, instance, args, kwargs):
    if _async_steps():
        kwargs["async_scheduling"] = True
    return wrapped(*args, **kwargs)


def apply(module, patcher) -> None:
    patcher.wrap(module, "MultiprocExecutor", _executor)
    if stock_loop(module.VllmHiddenStatesGenerator.generate):
        patcher.wrap(module.VllmHiddenStatesGenerator, "generate", _generate)
    else:
        log.debug("pipelined-steps: the stock generate() has another loop: the first step waits for every request")
    if "async_scheduling" in params(module.SchedulerConfig):
        patcher.wrap(module, "SchedulerConfig", _scheduler_config)


PATCH = declare(
    title="the next step is scheduled while the workers run the current one",
    delta="every step waits for a reply the stock loop never reads -> steps sent without waiting",
    api="vllm.v1.executor.multiproc_executor.MultiprocExecutor.execute_model/sample_tokens(non_block=)",
    kind=Kind.PERFORMANCE,
    # its proxy sits inside v5's two-phase proxy (which calls it) and outside v4's and v7's; it
    # wraps SchedulerConfig outside v1-chunked-prefill's (and inside v5's)
    after=("v7", "v1-chunked-prefill"),
    speculators=SPECULATORS_03,
)
