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

Detection: ``SchedulerConfig(enable_chunked_prefill=)`` defaults to ``True`` (0.11.0: ``None``,
i.e. off: delta absent; no such parameter: refused).

Remove when speculators 0.3.x is no longer supported.
"""

from __future__ import annotations

from speculators_compat.patching import Kind, Probe, declare, render

from .._probes import keyword_patch


def _judge(p) -> Probe:
    if "enable_chunked_prefill" not in p:
        return Probe.unknown(f"no enable_chunked_prefill parameter in SchedulerConfig{render(p)}")
    default = p["enable_chunked_prefill"].default
    text = f"SchedulerConfig(enable_chunked_prefill=) defaults to {default!r}"
    if default is True:
        return Probe.new(text)
    return Probe.old(text + " (chunked prefill off unless asked for)")


probe, static_probe, apply, CALLS = keyword_patch("SchedulerConfig", "enable_chunked_prefill", False, _judge)


PATCH = declare(
    title="chunked prefill off (the stock loop aborts partly prefilled prompts)",
    delta="stock loop aborts requests after one step; chunked prefill splits prompts across steps",
    api="vllm.config.SchedulerConfig(enable_chunked_prefill=)",
    kind=Kind.FIX,
    after=("v1",),  # wraps SchedulerConfig outside v1 (its keywords reach v1's wrapper)
    calls=CALLS,
)
