"""v4 -- ``collective_rpc(..., unique_reply_rank=r)`` returns one reply, not a list.

Delta (vLLM 0.11.1): ``MultiprocExecutor.collective_rpc`` returns the single reply of rank
``r`` when ``unique_reply_rank`` is given ("Returns single result if unique_reply_rank
... is provided, otherwise list"). Stock speculators 0.3.0 indexes the result with ``[0]``,
which now picks layer 0's tensor out of the reply; ``if not aux_hidden_states`` then
raises "Boolean value of Tensor with more than one value is ambiguous", or the results
come back as one row-tensor per token ("771 tensors of shape [512]").

How: the ``MultiprocExecutor`` name in the generator module is wrapped so the generator
gets a proxy of its executor whose ``collective_rpc`` puts a unique reply back in a
one-element list. Only calls made *by the generator* go through the proxy; vLLM's own
calls inside the executor (``execute_model`` uses ``unique_reply_rank`` too) are untouched.
For ``_get_captured_states`` the reply is also checked to be a list of tensors (or None).

Detection: the ``collective_rpc`` docstring states the single-result contract (0.11.1+);
``unique_reply_rank`` without it is the old list contract; no ``unique_reply_rank`` is
refused.

Remove when speculators 0.3.x is no longer supported (0.4.0 drops the ``[0]``).
"""

from __future__ import annotations

import wrapt

from speculators_compat.patching import CaptureContractError, Deferred, Probe, declare, render

from .._probes import params, static_params, vllm_module, wrapping

CONTRACT = "Returns single result if unique_reply_rank"


def _judge(p, doc) -> Probe:
    if "unique_reply_rank" not in p:
        return Probe.unknown(f"no unique_reply_rank in MultiprocExecutor.collective_rpc{render(p)}")
    doc = " ".join((doc or "").split())
    if CONTRACT in doc:
        return Probe.new(f"collective_rpc docstring: {CONTRACT!r}")
    return Probe.old("collective_rpc takes unique_reply_rank and documents no single-result contract")


def probe(module) -> Probe:
    rpc = module.MultiprocExecutor.collective_rpc
    return _judge(params(rpc), rpc.__doc__)


def static_probe(view) -> Probe:
    return _judge(
        static_params(view, "MultiprocExecutor", "collective_rpc"),
        view.vllm.docstring(vllm_module(view, "MultiprocExecutor"), "MultiprocExecutor", "collective_rpc"),
    )


class ReplyListExecutor(wrapt.ObjectProxy):
    """The generator's view of its executor: unique replies come back as ``[reply]``."""

    def collective_rpc(self, method, *args, unique_reply_rank=None, **kwargs):
        reply = self.__wrapped__.collective_rpc(method, *args, unique_reply_rank=unique_reply_rank, **kwargs)
        if unique_reply_rank is None:
            return reply
        if method == "_get_captured_states" and reply is not None:
            _check_captured(reply)
        return [reply]


def _check_captured(reply) -> None:
    import torch

    if isinstance(reply, Deferred):  # converted (and checked) by the patch that asked for it
        return
    if not isinstance(reply, list) or not all(isinstance(t, torch.Tensor) for t in reply):
        raise CaptureContractError(
            "collective_rpc('_get_captured_states', unique_reply_rank=0) returned "
            f"{type(reply).__name__}, expected a list of tensors (one per layer)"
        )


def _executor(wrapped, instance, args, kwargs):
    return ReplyListExecutor(wrapped(*args, **kwargs))


apply = wrapping({"MultiprocExecutor": _executor})


PATCH = declare(
    title="collective_rpc's single reply (vLLM 0.11.1) put back in a list",
    delta="collective_rpc(unique_reply_rank=r): [reply] -> reply",
    api="vllm.v1.executor.multiproc_executor.MultiprocExecutor.collective_rpc",
    upstream="speculators 0.4.0 uses the single reply",
)
