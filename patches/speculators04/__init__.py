"""speculators 0.4.x: bugs of its own generator loop that give wrong or missing results."""

from speculators_compat.patching import Kind

from .._ranges import SPECULATORS_04

#: what ``declare`` fills in for this group's patches (a declaration may name another)
PATCH_DEFAULTS = dict(kind=Kind.FIX, speculators=SPECULATORS_04, upstream="not fixed in speculators 0.4.0.1")
