"""The library's own guards: clear errors for bad input and broken results, a dead worker named,
atomic writes into a crash-safe output folder. Left off where no validation run recorded them."""

from speculators_compat.patching import Kind

from .._ranges import SPECULATORS_ALL, VLLM_TWO_PHASE

#: what ``declare`` fills in for this group's patches (a declaration may name another): the
#: library's own, on every speculators release from vLLM 0.11.1 on, not gated by the validation table
PATCH_DEFAULTS = dict(kind=Kind.GUARD, vllm=VLLM_TWO_PHASE, speculators=SPECULATORS_ALL, depends_on=())
