"""dtype -- let the user choose the model dtype.

Problem: the stock generator hard-codes ``ModelConfig(dtype="auto")``, so an fp32
checkpoint runs in half precision (bf16 on CPU): captured states then differ from an fp32
reference by up to ~5e-2, and MoE routing can flip.

How: ``VllmHiddenStatesGenerator(..., dtype="float32")`` is accepted (the wrapper takes the
keyword off before the stock constructor sees it), or the environment variable
``SPECULATORS_COMPAT_DTYPE`` sets a default for every generator. The ``ModelConfig`` name
in the generator module is wrapped to pass that dtype; with neither set, nothing changes.

Detection: ``ModelConfig`` takes ``dtype``.

For speculators 0.3.x and 0.4.x. Remove when speculators exposes the dtype (0.4.x does not).
"""

from __future__ import annotations

import contextvars

from speculators_compat.patching import Kind, Option, Probe, declare, render

from .._probes import params, static_params, wrapping

DTYPE = Option("SPECULATORS_COMPAT_DTYPE", "the model dtype of every generator that is not given one")
ENV = DTYPE.name
_requested: contextvars.ContextVar[str | None] = contextvars.ContextVar("speculators_compat_dtype", default=None)


def _judge(p) -> Probe:
    if "dtype" in p:
        return Probe.new("ModelConfig takes dtype; the generator hard-codes 'auto'")
    return Probe.unknown(f"no dtype parameter in ModelConfig{render(p)}")


def probe(module) -> Probe:
    return _judge(params(module.ModelConfig))


def static_probe(view) -> Probe:
    return _judge(static_params(view, "ModelConfig"))


def _init(wrapped, instance, args, kwargs):
    dtype = kwargs.pop("dtype", None) or DTYPE.raw() or None
    token = _requested.set(dtype)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _requested.reset(token)


def _model_config(wrapped, instance, args, kwargs):
    dtype = _requested.get()
    if dtype:
        kwargs["dtype"] = dtype
    return wrapped(*args, **kwargs)


apply = wrapping({"ModelConfig": _model_config, "VllmHiddenStatesGenerator.__init__": _init})


PATCH = declare(
    title="dtype choice",
    delta="ModelConfig(dtype='auto') hard-coded -> VllmHiddenStatesGenerator(dtype=...) / SPECULATORS_COMPAT_DTYPE",
    api="vllm.config.ModelConfig(dtype=)",
    kind=Kind.FEATURE,
    after=("runner-v1",),  # wraps __init__ outside it
    upstream="not in speculators 0.3.x / 0.4.x",
    remove_when="speculators exposes the dtype",
)
