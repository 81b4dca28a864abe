"""v6 -- ``Request(eos_token_id=)`` removed; the EOS id lives in ``SamplingParams``.

Delta (vLLM 0.17.0): ``vllm.v1.request.Request.__init__`` lost its ``eos_token_id``
parameter (a deprecated read-only ``Request.eos_token_id`` property returns
``sampling_params.eos_token_id`` instead); vLLM's own input processor puts the EOS id into the
request's ``SamplingParams`` with ``update_from_generation_config(generation_config,
eos_token_id)``, and ``check_stop`` reads ``sampling_params.eos_token_id``. Stock speculators
0.3.0 and 0.4.0.1 still call ``Request(..., eos_token_id=tokenizer.eos_token_id, ...)``:
``TypeError: Request.__init__() got an unexpected keyword argument 'eos_token_id'`` in the first
``generate()``, after the executor has started and the model has loaded.

How: the ``Request`` name in the generator module is wrapped; the wrapper takes
``eos_token_id`` off the call and hands it to the request's sampling parameters the way vLLM's
input processor does (``sampling_params.update_from_generation_config({}, eos_token_id)``), so
the request means what it meant on 0.16. (For extraction it is inert: the stock loop aborts
every request after its prefill and never asks the scheduler to check a stop.)

Detection: the stock ``Request(...)`` call (read from the installed generator's source: 0.3.0
passes six keywords, 0.4.0.1 adds ``block_hasher``) passes ``eos_token_id``, ``Request`` takes
no such parameter and ``SamplingParams.update_from_generation_config`` takes ``eos_token_id``
(new); ``Request`` still takes it (old); anything else is an unknown shape. That the rest of the
call binds is ``stock-calls``' job (this patch declares the keyword it drops).

Remove when speculators 0.3.x and 0.4.x are no longer supported (0.5 deleted the generator).
"""

from __future__ import annotations

from speculators_compat.patching import Edit, Probe, StaticView, declare, render, stock_calls

from .._probes import params, static_params, wrapping
from .._ranges import SPECULATORS_ALL

DROPPED = "eos_token_id"
SAMPLING = "vllm.sampling_params"


def _stock_keywords(view) -> set[str]:
    return {k for call in stock_calls(view) if call.name == "Request" for k in call.keywords}


def _judge(stock: set[str], request, update) -> Probe:
    if DROPPED not in stock:
        return Probe.old(f"the stock Request(...) call does not pass {DROPPED}")
    if DROPPED in request:
        return Probe.old(f"Request takes {DROPPED}")
    if update is None or DROPPED not in update:
        found = render(update) if update is not None else " (absent)"
        return Probe.unknown(
            f"Request{render(request)} takes no {DROPPED} and SamplingParams.update_from_generation_config{found} "
            f"takes none either"
        )
    return Probe.new(
        f"Request takes no {DROPPED}; SamplingParams.update_from_generation_config(generation_config, "
        f"{DROPPED}) carries it"
    )


def probe(module) -> Probe:
    from vllm.sampling_params import SamplingParams

    update = getattr(SamplingParams, "update_from_generation_config", None)
    if update is not None:
        update = params(update)
        update.pop("self", None)
    return _judge(_stock_keywords(StaticView()), params(module.Request), update)


def static_probe(view) -> Probe:
    update = view.vllm.params(SAMPLING, "SamplingParams", "update_from_generation_config")
    return _judge(_stock_keywords(view), static_params(view, "Request"), update)


def _request(wrapped, instance, args, kwargs):
    if DROPPED in kwargs:
        eos = kwargs.pop(DROPPED)
        sampling = kwargs.get("sampling_params")
        if eos is not None and sampling is not None:
            sampling.update_from_generation_config({}, eos)
    return wrapped(*args, **kwargs)


apply = wrapping({"Request": _request})


PATCH = declare(
    title="the EOS id through SamplingParams: Request lost eos_token_id (vLLM 0.17)",
    delta="Request(eos_token_id=) removed -> SamplingParams carries the EOS id",
    api="vllm.v1.request.Request(eos_token_id=) / vllm.sampling_params.SamplingParams.update_from_generation_config",
    vllm=">=0.17",
    speculators=SPECULATORS_ALL,
    calls={"Request": Edit(drop=(DROPPED,))},
    upstream="vllm 0.17.0 (Request.eos_token_id deprecated, read from sampling_params); "
    "speculators 0.3.x/0.4.x still pass eos_token_id",
    remove_when="speculators 0.3.x and 0.4.x are no longer supported",
)
