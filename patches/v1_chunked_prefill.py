"""v1-chunked-prefill -- no partially prefilled sequence may be aborted.

Problem: when a batch's total tokens exceed ``max_num_batched_tokens`` (the stock
generator uses ``max(8192, max_model_len)``), vLLM's scheduler splits the last prompt
of a step across steps, and the stock loop aborts every scheduled request after one
step. Measured on vLLM 0.16: 3 x 3000 tokens -> sequence 2 came back with 2192 rows
instead of 3000; 4 x 3000 -> sequence 2's rows were partly sequence 3's. No error.

How: the ``SchedulerConfig`` name in the generator module is wrapped to pass
``enable_chunked_prefill=False``. Each step then holds whole prompts only (a single
prompt always fits, since ``max_num_batched_tokens >= max_model_len``), so aborting after
the step loses nothing; the remaining prompts run in the next steps, in order.

Detection: ``SchedulerConfig`` takes ``enable_chunked_prefill`` (otherwise refused).

Covers: vLLM 0.12.0 - 0.16.x with speculators 0.3.x (on older releases the stock
behaviour is kept, see the version-matrix issue).
Remove when speculators 0.3.x is no longer supported.
"""

from __future__ import annotations

from speculators_compat.registry import Patch, Probe

from ._common import GENERATOR, SPECULATORS_03, VALIDATED_016, params, signature_text


def probe(module) -> Probe:
    p = params(module.SchedulerConfig)
    if "enable_chunked_prefill" not in p:
        return Probe.unknown(
            f"no enable_chunked_prefill parameter in {signature_text(module.SchedulerConfig)}"
        )
    return Probe.new(f"SchedulerConfig(enable_chunked_prefill=) defaults to {p['enable_chunked_prefill'].default!r}")


def _scheduler_config(wrapped, instance, args, kwargs):
    kwargs["enable_chunked_prefill"] = False
    return wrapped(*args, **kwargs)


def apply(module, patcher) -> None:
    patcher.wrap(module, "SchedulerConfig", _scheduler_config)


PATCH = Patch(
    id="v1-chunked-prefill",
    title="chunked prefill off",
    delta="stock loop aborts requests after one step; chunked prefill splits prompts across steps",
    api="vllm.config.SchedulerConfig(enable_chunked_prefill=)",
    side="driver",
    target=GENERATOR,
    vllm=VALIDATED_016,
    speculators=SPECULATORS_03,
    probe=probe,
    apply=apply,
    kind="fix",
    upstream="not fixed in speculators 0.3.x",
    remove_when="speculators 0.3.x is no longer supported",
)
