"""v9: the probe reads CacheConfig's ``enable_extensible_kv_cache``; the wrapper turns it off
unless the caller chose."""

from __future__ import annotations

import types

from probe_inputs import sig
from speculators_compat.patches.vllm_api import v9


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {
    "v9": (
        "vLLM 0.34 has no CPU build: its delta is read from the real wheel (tests/test_check_root.py, tox"
        " check0340) and the extraction ran on an H200 (docs/gpu.md)"
    ),
}


def test_the_judgement():
    assert v9._judge(sig("block_size", optional=(v9.FIELD,))).shape.value == "new"
    assert v9._judge(sig("block_size")).shape.value == "old"


def test_the_extensible_kv_cache_is_off_unless_chosen():
    from speculators_compat.core.patcher import Patcher

    module = types.SimpleNamespace(CacheConfig=lambda **kw: kw)  # the generator's CacheConfig name
    patcher = Patcher()
    v9.apply(module, patcher)
    assert module.CacheConfig(block_size=16) == {"block_size": 16, v9.FIELD: False}
    assert module.CacheConfig(**{v9.FIELD: True})[v9.FIELD] is True  # the caller's choice stays
    assert v9.PATCH.calls["CacheConfig"].add == (v9.FIELD,)
    patcher.undo()
    assert module.CacheConfig(block_size=16) == {"block_size": 16}
