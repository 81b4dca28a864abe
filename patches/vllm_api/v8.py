"""v8 -- the stock generator's KV-cache helpers, moved to ``kv_cache_planning`` in vLLM 0.33.

Delta (vLLM 0.33.0, vLLM PR #42309, a pure move): ``_get_kv_cache_groups_uniform_spec``,
``get_kv_cache_config_from_groups`` and ``unify_hybrid_kv_cache_specs`` left
``vllm.v1.core.kv_cache_utils`` for ``vllm.v1.core.kv_cache_planning``, unchanged, and
``kv_cache_utils`` does not re-export them: the stock generator's
``from vllm.v1.core.kv_cache_utils import (...)`` fails with ``ImportError``.

How: when ``speculators.config`` is imported (while ``import speculators`` runs, before the
generator module can be), the three names are bound in ``kv_cache_utils`` to the functions
``kv_cache_planning`` defines -- the same objects; nothing else changes. Undo deletes them.
The patches that wrap these helpers (``v1``) see them where the generator imports them, and the
static check reads them where they are now (``moves``).

Detection (from the installed sources, no vLLM import): ``kv_cache_utils`` binds the three
names: not needed. ``kv_cache_planning`` binds them: new. Neither: unknown, refused, naming
where each name went.

Remove when speculators 0.3.x and 0.4.x are no longer supported (speculators 0.5 uses vLLM's
own extraction).
"""

from __future__ import annotations

from speculators_compat.patching import SPECULATORS_CONFIG, Probe, declare

from .._ranges import SPECULATORS_ALL

UTILS = "vllm.v1.core.kv_cache_utils"
PLANNING = "vllm.v1.core.kv_cache_planning"
NAMES = ("_get_kv_cache_groups_uniform_spec", "get_kv_cache_config_from_groups", "unify_hybrid_kv_cache_specs")
#: where the stock code imports them -> where vLLM 0.33 defines them
MOVES = {f"{UTILS}.{name}": PLANNING for name in NAMES}


def _judge(src) -> Probe:
    if not src.found:
        return Probe.unknown("vLLM's sources cannot be read")
    here = [n for n in NAMES if src.defines(UTILS, n, moves=False)]
    if len(here) == len(NAMES):
        return Probe.old(f"{UTILS} defines {', '.join(NAMES)}")
    there = [n for n in NAMES if src.defines(PLANNING, n, moves=False)]
    if len(here) + len(there) == len(NAMES) and there:
        return Probe.new(f"{', '.join(there)} moved from {UTILS} to {PLANNING}")
    from speculators_compat.patching import where_now

    gone = [n for n in NAMES if n not in here and n not in there]
    return Probe.unknown("; ".join(f"{n}{where_now(src, UTILS, n)}" for n in gone))


def probe(module) -> Probe:
    from speculators_compat.patching import Sources

    return _judge(Sources("vllm"))


def static_probe(view) -> Probe:
    return _judge(view.vllm)


def apply(module, patcher) -> None:
    import importlib

    utils = importlib.import_module(UTILS)
    planning = importlib.import_module(PLANNING)
    for name in NAMES:
        if name not in vars(utils):
            patcher.define(utils, name, getattr(planning, name))


PATCH = declare(
    title="the stock KV-cache helper imports resolve where vLLM 0.33 moved them",
    delta="vllm.v1.core.kv_cache_utils.{_get_kv_cache_groups_uniform_spec, get_kv_cache_config_from_groups, "
    "unify_hybrid_kv_cache_specs} -> vllm.v1.core.kv_cache_planning",
    api=f"{UTILS} -> {PLANNING}",
    vllm=">=0.33",
    target=SPECULATORS_CONFIG,  # the driver's side, as every process that imports speculators binds it
    speculators=SPECULATORS_ALL,
    moves=MOVES,
    upstream="vLLM PR #42309 (0.33.0) moved the KV-cache planning helpers; speculators 0.3.x/0.4.x import the old path",
    remove_when="speculators 0.3.x and 0.4.x are no longer supported",
)
