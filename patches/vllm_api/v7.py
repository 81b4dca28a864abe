"""v7 -- the KV cache layout is resolved by the engine core before the KV cache is sized.

Delta (vLLM 0.29.0): ``CacheConfig`` gained ``kv_cache_layout`` (``None`` until resolved) and
``get_kv_cache_config_from_groups`` reads ``cache_config.get_resolved_kv_cache_layout()``, which
raises "KV cache layout has not been resolved yet; it is resolved once by the engine core
(resolve_kv_cache_layout)". ``EngineCore._initialize_kv_caches`` does that resolution: it asks
every worker which layouts its attention backends support
(``executor.get_supported_kv_cache_layouts()``), calls
``vllm.v1.attention.backends.utils.resolve_kv_cache_layout(vllm_config, supported, specs)`` and
publishes the result to the workers (``executor.set_kv_cache_layout(name)``), before the KV
cache is sized and allocated. Stock speculators drives the executor without an engine core: on
0.29+ its ``VllmHiddenStatesGenerator(...)`` fails with that ValueError after the model load.
vLLM 0.33 publishes the context-parallel interleave size with the layout:
``set_kv_cache_layout(layout_name, cp_kv_cache_interleave_size)`` (the engine core first lets
``VllmConfig.adjust_dcp_kv_cache_interleave_size`` adjust it, which only acts for NIXL P/D with
decode context parallelism -- never in the generator's configuration).

How: the ``MultiprocExecutor`` name in the generator module is wrapped; once the executor has
started (the model is loaded, so the workers know their KV cache specs and backends), the
wrapper does what the engine core does -- read the specs and the supported layouts from the
workers, resolve one layout into the driver's ``cache_config`` and publish it to the workers (with ``parallel_config.cp_kv_cache_interleave_size`` where
``set_kv_cache_layout`` takes it) --
so the stock ``get_kv_cache_config_from_groups`` and ``initialize_from_config`` that follow see
the same layout vLLM's own engine would have chosen (a layout the user pinned with
``VLLM_KV_CACHE_LAYOUT`` is honoured by ``resolve_kv_cache_layout`` itself).

Detection: ``CacheConfig.get_resolved_kv_cache_layout`` exists (new) or not (old); new also
requires ``resolve_kv_cache_layout(vllm_config, supported_layouts, kv_cache_specs)`` and the
executor's ``get_supported_kv_cache_layouts`` and ``set_kv_cache_layout(layout_name[,
cp_kv_cache_interleave_size])``; a partial set or another signature is an unknown shape (refused).

Remove when speculators 0.3.x is no longer supported (0.5 uses vLLM's own engine).
"""

from __future__ import annotations

from speculators_compat.patching import Probe, declare, render

from .._probes import params, vllm_module, wrapping
from .._ranges import SPECULATORS_ALL

UTILS = "vllm.v1.attention.backends.utils"
RESOLVE = "resolve_kv_cache_layout"
RESOLVE_PARAMS = ["vllm_config", "supported_layouts", "kv_cache_specs"]
EXECUTOR_METHODS = ("get_supported_kv_cache_layouts", "set_kv_cache_layout")
#: ``set_kv_cache_layout``'s parameters: 0.29 - 0.32, and 0.33 on
SET_LAYOUT_SHAPES = (["layout_name"], ["layout_name", "cp_kv_cache_interleave_size"])


def _judge(resolved_getter: bool, resolve, executor_methods: set[str], set_layout=None) -> Probe:
    if not resolved_getter:
        if resolve is None:
            return Probe.old("CacheConfig has no get_resolved_kv_cache_layout (the layout is not resolved up front)")
        return Probe.unknown(f"{UTILS}.{RESOLVE} exists but CacheConfig has no get_resolved_kv_cache_layout")
    missing = [m for m in EXECUTOR_METHODS if m not in executor_methods]
    if resolve is None or list(resolve)[:3] != RESOLVE_PARAMS or missing:
        found = render(resolve) if resolve is not None else " (absent)"
        return Probe.unknown(
            f"CacheConfig.get_resolved_kv_cache_layout exists; expected {UTILS}.{RESOLVE}"
            f"({', '.join(RESOLVE_PARAMS)}) and MultiprocExecutor.{'/'.join(EXECUTOR_METHODS)}, found "
            f"{RESOLVE}{found}" + (f", executor lacks {', '.join(missing)}" if missing else "")
        )
    if set_layout is not None and list(set_layout) not in SET_LAYOUT_SHAPES:
        return Probe.unknown(f"MultiprocExecutor.set_kv_cache_layout{render(set_layout)}: expected "
                             + " or ".join(f"({', '.join(p)})" for p in SET_LAYOUT_SHAPES))
    return Probe.new(
        "get_kv_cache_config_from_groups reads CacheConfig.get_resolved_kv_cache_layout(); "
        f"the engine core resolves it with {RESOLVE}(...) and executor.set_kv_cache_layout"
    )


def probe(module) -> Probe:
    import importlib

    try:
        resolve = params(getattr(importlib.import_module(UTILS), RESOLVE))
    except (ImportError, AttributeError):
        resolve = None
    executor = module.MultiprocExecutor
    method = getattr(executor, "set_kv_cache_layout", None)
    set_layout = {k: v for k, v in params(method).items() if k != "self"} if method is not None else None
    return _judge(
        hasattr(module.CacheConfig, "get_resolved_kv_cache_layout"),
        resolve,
        {m for m in EXECUTOR_METHODS if hasattr(executor, m)},
        set_layout,
    )


def static_probe(view) -> Probe:
    cache = vllm_module(view, "CacheConfig")
    executor = vllm_module(view, "MultiprocExecutor")
    return _judge(
        "get_resolved_kv_cache_layout" in view.vllm.members(cache, "CacheConfig"),
        view.vllm.params(UTILS, RESOLVE),
        view.vllm.members(executor, "MultiprocExecutor"),
        view.vllm.params(executor, "MultiprocExecutor", "set_kv_cache_layout"),
    )


def resolve_layout(executor) -> str:
    """Resolve the KV cache layout as ``EngineCore`` does, into the driver's config and the workers'."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    specs = executor.collective_rpc("get_kv_cache_spec")
    layout = resolve_kv_cache_layout(
        executor.vllm_config,
        executor.get_supported_kv_cache_layouts(),
        [spec for worker_specs in specs for spec in worker_specs.values()],
    )
    config = executor.vllm_config
    if "cp_kv_cache_interleave_size" in params(executor.set_kv_cache_layout):
        executor.set_kv_cache_layout(layout.name, config.parallel_config.cp_kv_cache_interleave_size)
    else:
        executor.set_kv_cache_layout(layout.name)
    return layout.name


def _executor(wrapped, instance, args, kwargs):
    executor = wrapped(*args, **kwargs)
    resolve_layout(executor)
    return executor


apply = wrapping({"MultiprocExecutor": _executor})


PATCH = declare(
    title="KV cache layout resolved as the engine core does (vLLM 0.29)",
    delta="get_kv_cache_config_from_groups needs CacheConfig.kv_cache_layout, resolved by the engine core",
    api="vllm.config.CacheConfig.get_resolved_kv_cache_layout / "
    "vllm.v1.attention.backends.utils.resolve_kv_cache_layout",
    vllm=">=0.29",
    after=("v4",),  # wraps MultiprocExecutor outside v4's proxy
    speculators=SPECULATORS_ALL,
    upstream="vllm 0.29.0 (KV cache layouts resolved once in EngineCore); speculators 0.3.x/0.4.x "
    "drive the executor without an engine core",
    remove_when="speculators 0.3.x and 0.4.x are no longer supported",
)
