"""vLLM changes the stock speculators 0.3.x generator and worker trip on: API deltas (``v1`` ..
``v7``) and changed defaults that make its results wrong (chunked prefill, prefix caching, Model
Runner V2)."""

from .._ranges import SPECULATORS_03, VLLM_TWO_PHASE

#: what ``declare`` fills in for this group's patches (a declaration may name another): deltas
#: (the kind ``Patch`` defaults to) of the stock speculators 0.3.x code, from vLLM 0.11.1 on
PATCH_DEFAULTS = dict(vllm=VLLM_TWO_PHASE, speculators=SPECULATORS_03)
