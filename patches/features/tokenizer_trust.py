"""tokenizer-trust -- the generator's own tokenizer load trusts the checkpoint's code as
the rest of the generator does.

Problem (speculators 0.3.x and 0.4.x, any vLLM): ``VllmHiddenStatesGenerator.__init__`` loads
the model's config with ``AutoConfig.from_pretrained(model_path, trust_remote_code=True)`` and
gives vLLM ``ModelConfig(trust_remote_code=True)`` (so the checkpoint's code runs in the driver
and in every worker), but loads its own tokenizer -- used only for ``eos_token_id`` -- with
``AutoTokenizer.from_pretrained(model_path)``, without ``trust_remote_code``. A checkpoint whose
tokenizer is its own code (moonshotai/Kimi-K2 and Kimi-K2.5: ``tokenization_kimi.py`` through
``tokenizer_config.json``'s ``auto_map``, no ``tokenizer.json``) then stops the generator before
the engine starts: transformers asks "Do you wish to run the custom code? [y/N]" and, with no
terminal (a batch job) or no answer within 15 s, raises ``ValueError: The repository ...
contains custom code which must be executed ... Please pass the argument
`trust_remote_code=True```. Measured with the tiny Kimi-K2.5 checkpoint
(``speculators_compat.testing.tiny.build_kimi_k25``), whose tokenizer is laid out like the real one.

How: while ``VllmHiddenStatesGenerator.__init__`` runs, a call of
``AutoTokenizer.from_pretrained`` for the generator's own ``model_path`` that does not say
``trust_remote_code`` gets ``trust_remote_code=True`` -- the choice the generator already made
for the same checkpoint's config and engine; any other call (another path, another thread,
outside the constructor, or one that passes the argument) is untouched. ``AutoTokenizer`` is the
class the generator module imported from transformers, so the wrapper sits on
``transformers.AutoTokenizer.from_pretrained`` and is inert outside the constructor.

Detection (the source of ``VllmHiddenStatesGenerator.__init__``): it calls
``AutoTokenizer.from_pretrained`` without ``trust_remote_code`` and ``AutoConfig.from_pretrained``
with ``trust_remote_code=True`` (new); the tokenizer call passes ``trust_remote_code``, or there is
no tokenizer call, or the generator trusts no remote code at all (old: not needed); no config call
(unknown).

Kind: a feature (it lets models with a remote-code tokenizer run; it changes no data, and
without it those models fail loudly before the engine starts). Its delta is in speculators, not
in vLLM: it applies wherever its probe finds it, on every release from vLLM 0.11.1 (on 0.11.0,
what speculators 0.3.0 was written for, nothing of ours wraps the stock code). Covers: speculators 0.3.x and 0.4.x
(same code).
Remove when speculators passes ``trust_remote_code`` to its tokenizer load.
"""

from __future__ import annotations

import contextvars
import logging

from speculators_compat.patching import Kind, Probe, declare

from .._probes import generate_probes, wrapping

log = logging.getLogger("speculators_compat")

TOKENIZER_CALL = "AutoTokenizer.from_pretrained("
CONFIG_CALL = "AutoConfig.from_pretrained("

#: the model path of the generator whose constructor is running in this context
_loading: contextvars.ContextVar[str | None] = contextvars.ContextVar("speculators_compat_tokenizer", default=None)


def _call_args(source: str, call: str) -> str | None:
    """The argument text of the first ``call(...)`` in ``source`` (``None``: no such call)."""
    start = source.find(call)
    if start < 0:
        return None
    depth, i = 1, start + len(call)
    while i < len(source) and depth:
        depth += {"(": 1, ")": -1}.get(source[i], 0)
        i += 1
    return source[start + len(call) : i - 1]


def _judge(source: str) -> Probe:
    tokenizer = _call_args(source, TOKENIZER_CALL)
    config = _call_args(source, CONFIG_CALL)
    if config is None:
        return Probe.unknown("VllmHiddenStatesGenerator.__init__ does not call AutoConfig.from_pretrained")
    if tokenizer is None:
        return Probe.old("VllmHiddenStatesGenerator.__init__ loads no tokenizer through AutoTokenizer")
    if "trust_remote_code" in tokenizer:
        return Probe.old(f"the generator's tokenizer load passes trust_remote_code ({TOKENIZER_CALL}{tokenizer})")
    if "trust_remote_code=True" not in config.replace(" ", ""):
        return Probe.old("the generator trusts no remote code (its AutoConfig load does not either)")
    return Probe.new(
        f"the generator loads its config with trust_remote_code=True but its tokenizer with "
        f"{TOKENIZER_CALL}{tokenizer})"
    )


probe, static_probe = generate_probes(_judge, "__init__")


def _model_path(args, kwargs):
    if "model_path" in kwargs:
        return kwargs["model_path"]
    return args[0] if args else None


def _init(wrapped, instance, args, kwargs):
    path = _model_path(args, kwargs)
    token = _loading.set(str(path) if path is not None else None)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _loading.reset(token)


def _from_pretrained(wrapped, instance, args, kwargs):
    path = _loading.get()
    name = kwargs.get("pretrained_model_name_or_path", args[0] if args else None)
    if path is not None and name is not None and str(name) == path and "trust_remote_code" not in kwargs:
        kwargs["trust_remote_code"] = True
        log.debug("generator tokenizer for %s: trust_remote_code=True, as for its config and engine", path)
    return wrapped(*args, **kwargs)


apply = wrapping({
    "AutoTokenizer.from_pretrained": _from_pretrained,
    "VllmHiddenStatesGenerator.__init__": _init,
})


PATCH = declare(
    title="the generator's tokenizer load trusts remote code like its config load",
    delta="AutoTokenizer.from_pretrained(model_path) without trust_remote_code -> trust_remote_code=True "
    "(as AutoConfig and ModelConfig already get)",
    api="speculators VllmHiddenStatesGenerator.__init__: AutoTokenizer.from_pretrained",
    kind=Kind.FEATURE,
    depends_on=(),
    after=("spawn-workers",),  # wraps __init__ outside it
    upstream="not fixed in speculators 0.3.x / 0.4.x",
    remove_when="speculators passes trust_remote_code to its tokenizer load",
)
