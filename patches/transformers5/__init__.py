"""transformers v5: what ``import speculators`` 0.3.0 needs to work at all (in the driver and in
every vLLM worker)."""

from speculators_compat.patching import Kind

from .._ranges import SPECULATORS_03

#: what ``declare`` fills in for this group's patches (a declaration may name another): both are
#: repairs of the import of speculators itself, in the driver and in every vLLM worker, and so depend on
#: the transformers release
PATCH_DEFAULTS = dict(kind=Kind.PLATFORM, speculators=SPECULATORS_03, depends_on=("transformers",))
