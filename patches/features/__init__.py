"""Options and improvements the stock code does not have (same results): a dtype choice, a
tokenizer load that trusts remote code, faster and lighter transport of the captured states, the
driver's threads, the report lines. Left off where no validation run recorded them."""

from .._ranges import SPECULATORS_ALL, VLLM_TWO_PHASE

#: what ``declare`` fills in for this group's patches (a declaration may name another; the data
#: path's are for speculators 0.3.x: ``datapath.PATCH_DEFAULTS``)
PATCH_DEFAULTS = dict(vllm=VLLM_TWO_PHASE, speculators=SPECULATORS_ALL)
