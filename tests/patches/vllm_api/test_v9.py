"""v9: the probe reads CacheConfig's ``enable_extensible_kv_cache``; the wrapper turns it off
unless the caller chose."""

from __future__ import annotations

from probe_inputs import sig
from speculators_compat.patches.vllm_api import v9


def test_the_judgement():
    assert v9._judge(sig("block_size", optional=(v9.FIELD,))).shape.value == "new"
    assert v9._judge(sig("block_size")).shape.value == "old"


def test_the_extensible_kv_cache_is_off_unless_chosen():
    seen = {}
    v9._cache_config(lambda **kw: seen.update(kw), None, (), {"block_size": 16})
    assert seen == {"block_size": 16, v9.FIELD: False}
    v9._cache_config(lambda **kw: seen.update(kw), None, (), {v9.FIELD: True})
    assert seen[v9.FIELD] is True
