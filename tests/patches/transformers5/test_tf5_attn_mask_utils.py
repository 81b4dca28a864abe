"""tf5-attn-mask-utils: the stand-in of the removed transformers module exists only while
speculators populates its model registry."""

from __future__ import annotations

import importlib
import sys

import pytest


#: end to end (tests/test_e2e.py, wherever the probe finds the delta): the step that fails when the
#: patch alone is disabled (with the stock-calls check off), and a fragment of the failure
NEEDED_WHERE = {
    # transformers >= 5.24: `import speculators` 0.3.0 fails without it
    "tf5-attn-mask-utils": ("start", "No module named 'transformers.modeling_attn_mask_utils'"),
}


def test_tf5_attn_mask_stand_in_exists_only_while_speculators_populates(monkeypatch):
    from speculators_compat.errors import CompatError
    from speculators_compat.patches.transformers5 import tf5_attn_mask_utils as patch

    monkeypatch.setattr(patch, "_module_exists", lambda: False)
    monkeypatch.delitem(sys.modules, patch.REMOVED, raising=False)
    seen = {}

    def populate():
        module = importlib.import_module(patch.REMOVED)
        seen["function"] = getattr(module, patch.FUNCTION)
        return "populated"

    assert patch._reload_and_populate(populate, None, (), {}) == "populated"
    assert patch.REMOVED not in sys.modules
    with pytest.raises(CompatError, match="removed in transformers 5.24"):
        seen["function"](None, (1, 2), None, 0)
