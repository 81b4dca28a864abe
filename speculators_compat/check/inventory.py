"""The vLLM APIs the stock extraction code calls, and the shapes the registry knows.

Every name the stock generator and worker extension import from vLLM (read from the
installed speculators sources), plus the methods they call on the executor and the
scheduler, is looked up in the installed vLLM sources (:mod:`speculators_compat.check.sources`,
nothing imported). Each API's signature is compared with the signatures recorded from the
real vLLM releases this library is validated on (``known_apis.json``, written by
``python -m speculators_compat.check.inventory --record`` in each release's environment):

- ``known``: the signature is one recorded on a validated release (named);
- ``compatible``: not recorded, but it only adds optional parameters to a recorded one
  (what nightlies usually do), or drops optional parameters that no stock call passes (vLLM
  0.17's ``ModelConfig`` lost ``logits_processor_pattern``): every call the stock code makes
  still binds (the ``stock-calls`` check binds each of them to the installed signature);
- ``unknown``: a name that is gone, a parameter removed, a new required parameter: named
  with the module, the expected signature (newest recorded) and the one found.

An unknown shape means the installed vLLM has drifted beyond what the registry knows;
the ``api-inventory`` check (:mod:`speculators_compat.check.checks`) turns that into a refusal
before the executor starts (``SPECULATORS_COMPAT_DISABLE=api-inventory`` proceeds at the user's risk).
"""

from __future__ import annotations

import json
import os
import sys
from functools import lru_cache

from .sources import Sources, StaticView, render
from ..core.targets import GENERATOR, WORKER

__all__ = ["inventory", "unknown", "KNOWN_FILE"]

KNOWN_FILE = os.path.join(os.path.dirname(__file__), "known_apis.json")

#: methods the stock code calls on objects (not imports): (module, class, method)
METHODS = (
    ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor", "collective_rpc"),
    ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor", "execute_model"),
    ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor", "sample_tokens"),
    ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor", "shutdown"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "add_request"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "finish_requests"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"),
)

#: the imports of speculators 0.3.0 and 0.4.0.1 (recorded even when another is installed)
IMPORTS = (
    ("vllm.config", "CacheConfig"),
    ("vllm.config", "DeviceConfig"),
    ("vllm.config", "LoadConfig"),
    ("vllm.config", "ModelConfig"),
    ("vllm.config", "ParallelConfig"),
    ("vllm.config", "SchedulerConfig"),
    ("vllm.config", "VllmConfig"),
    ("vllm.sampling_params", "SamplingParams"),
    ("vllm.utils.hashing", "get_hash_fn_by_name"),
    ("vllm.v1.core.kv_cache_utils", "_get_kv_cache_groups_uniform_spec"),
    ("vllm.v1.core.kv_cache_utils", "get_kv_cache_config_from_groups"),
    ("vllm.v1.core.kv_cache_utils", "get_request_block_hasher"),
    ("vllm.v1.core.kv_cache_utils", "init_none_hash"),
    ("vllm.v1.core.kv_cache_utils", "unify_hybrid_kv_cache_specs"),
    ("vllm.v1.core.sched.scheduler", "Scheduler"),
    ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor"),
    ("vllm.v1.request", "Request"),
    ("vllm.v1.request", "RequestStatus"),
    ("vllm.v1.structured_output", "StructuredOutputManager"),
    ("vllm.distributed", "get_pp_group"),
    ("vllm.distributed", "get_tp_group"),
    ("vllm.model_executor.models.interfaces", "supports_eagle3"),
    ("vllm.sequence", "IntermediateTensors"),
)

ABSENT = "(absent)"
PRESENT = "(defined)"


def shape(src: Sources, module: str, name: str, method: str | None = None) -> str:
    """One API's shape as read from the sources: its rendered signature, ``(defined)`` for a
    name that exists but has no readable signature, or ``(absent)``."""
    if method is not None:
        if not src.mro(module, name):
            return ABSENT
        params = src.params(module, name, method)
        if params is None:
            return PRESENT if src.member(module, name, method) else ABSENT
        return render(params)
    if not src.defines(module, name):
        return ABSENT
    hit = src.resolve(module, name)
    if hit is None:
        return PRESENT
    params = src.params(module, name)
    return render(params) if params is not None else PRESENT


def api_name(module: str, name: str, method: str | None = None) -> str:
    return f"{module}.{name}" + (f".{method}" if method else "")


def apis(view: StaticView) -> list[tuple[str, str, str | None]]:
    """The APIs to look at: the installed speculators' vLLM imports, then the called methods."""
    out: list[tuple[str, str, str | None]] = []
    for module in (GENERATOR, WORKER):
        for mod, name in view.speculators.imports(module, "vllm"):
            if (mod, name, None) not in out:
                out.append((mod, name, None))
    if not out:  # speculators not installed: the recorded list
        out = [(m, n, None) for m, n in IMPORTS]
    return out + [(m, c, meth) for m, c, meth in METHODS]


@lru_cache(maxsize=1)
def known() -> dict[str, dict[str, list[str]]]:
    """``{api: {signature: [releases]}}`` recorded from the validated vLLM releases."""
    with open(KNOWN_FILE, encoding="utf-8") as fh:
        return json.load(fh)["apis"]


KNOWN, COMPATIBLE, UNKNOWN = "known", "compatible", "unknown"


def passed(view: StaticView) -> dict[str, set[str] | None]:
    """``{api: parameter names the stock calls pass}`` (keywords, and the first positional
    parameters by their recorded order); an API that is imported but never called by the
    generator is absent (every parameter then counts as used)."""
    from .calls import stock_calls

    out: dict[str, set[str]] = {}
    for call in stock_calls(view):
        api = api_name(call.module, call.cls, call.method)
        names = out.setdefault(api, set())
        names.update(call.keywords)
        if call.positional:
            order = _parse(shape(view.vllm, call.module, call.cls, call.method)) or {}
            names.update(list(order)[: call.positional])
    return out


def inventory(view: StaticView | None = None) -> list[dict]:
    """One entry per API: ``{"api", "found", "status", "releases", "expected"}`` (computed once
    per view: the preflight check and the report share it)."""
    view = view or StaticView()
    cached = getattr(view, "_inventory", None)
    if cached is None:
        cached = view._inventory = _inventory(view)
    return cached


def _inventory(view: StaticView) -> list[dict]:
    table = known()
    used = passed(view)
    out = []
    for module, name, method in apis(view):
        api = api_name(module, name, method)
        found = shape(view.vllm, module, name, method)
        seen = table.get(api, {})
        releases = seen.get(found, [])
        status = KNOWN
        if not releases:
            like = [rel for sig, rel in seen.items() if extends(found, sig, used.get(api))]
            releases = max(like, key=newest_release) if like else []
            status = COMPATIBLE if like else UNKNOWN
        entry = {
            "api": api,
            "found": found,
            "status": status,
            "releases": releases,
            "expected": {sig: rel for sig, rel in seen.items() if sig != found},
        }
        moved = view.vllm.moved_to(module, name) if method is None else None
        if moved:
            entry["moved_to"] = moved
        if status == UNKNOWN:
            entry["difference"] = difference(found, seen)
            if found == ABSENT and method is None:
                entry["difference"] += where_now(view.vllm, module, name)
        out.append(entry)
    return out


def difference(found: str, seen: dict[str, list[str]]) -> str:
    """What sets ``found`` apart from the newest recorded shape, in words."""
    if not seen:
        return "never recorded on a validated release"
    sig, rel = max(seen.items(), key=lambda kv: newest_release(kv[1]))
    new, old = _parse(found), _parse(sig)
    if new is None or old is None:
        return f"{found} instead of {sig} (vLLM {rel[-1]})"
    parts = []
    gone = [n for n in old if n not in new]
    if gone:
        parts.append("parameters removed: " + ", ".join(gone))
    now_required = [n for n, req in new.items() if req and not old.get(n, False)]
    if now_required:
        parts.append("parameters now required: " + ", ".join(now_required))
    return "; ".join(parts) + f" (against vLLM {rel[-1]})"


def where_now(src: Sources, module: str, name: str) -> str:
    """For a name gone from ``module``: where the installed package defines it now, in words."""
    homes = [m for m in src.definitions(name, near=module) if m != module]
    if not homes:
        return f"; {name} is defined nowhere in the installed {src.top}: removed"
    return (f"; moved: {name} is defined in {homes[0]}" + (f" (and {len(homes) - 1} more)" if len(homes) > 1 else "")
            + f", and {module} no longer binds it: no patch of this release re-binds it")


def _parse(sig: str) -> dict[str, bool] | None:
    """``{name: required}`` from :func:`~speculators_compat.check.sources.render` text."""
    if sig in (ABSENT, PRESENT) or not sig.startswith("("):
        return None
    out = {}
    for part in filter(None, (p.strip() for p in sig[1:-1].split(","))):
        name = part.lstrip("*").rstrip("=")
        out[name] = not part.endswith("=") and not part.startswith("*")
    return out


def extends(found: str, recorded: str, used: set[str] | None = None) -> bool:
    """``found`` keeps every parameter of ``recorded`` that is required or that the stock
    calls pass (``used``; None: every parameter counts as used), and adds only optional ones."""
    new, old = _parse(found), _parse(recorded)
    if new is None or old is None:
        return False
    kept = all(name in new for name, req in old.items() if req or used is None or name in used)
    return kept and all(not req or old.get(name, False) for name, req in new.items())


def unknown(entries: list[dict]) -> list[str]:
    """A precise line for every API whose shape the registry does not know."""
    lines = []
    for e in entries:
        if e["status"] != UNKNOWN:
            continue
        lines.append(f"{e['api']}: {e['difference']}")
    return lines


def newest_release(releases: list[str]) -> tuple:
    """The newest of ``releases`` (version strings), as a sort key."""
    from packaging.version import Version

    return max(Version(r) for r in releases)


def record(view: StaticView | None = None) -> dict[str, str]:
    """The shapes of every recorded API in the installed vLLM (for ``known_apis.json``)."""
    view = view or StaticView()
    names = [(m, n, None) for m, n in IMPORTS] + [(m, c, meth) for m, c, meth in METHODS]
    return {api_name(m, n, meth): shape(view.vllm, m, n, meth) for m, n, meth in names}


def merge(release: str, shapes: dict[str, str], path: str = KNOWN_FILE) -> None:
    """Add one release's shapes to the table file."""
    data = {"releases": [], "apis": {}}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    if release not in data["releases"]:
        data["releases"].append(release)
    from packaging.version import Version

    data["releases"].sort(key=Version)
    for api, sig in shapes.items():
        for rels in data["apis"].setdefault(api, {}).values():
            if release in rels:
                rels.remove(release)
        rels = data["apis"][api].setdefault(sig, [])
        rels.append(release)
        rels.sort(key=Version)
        data["apis"][api] = {s: r for s, r in data["apis"][api].items() if r}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.write("\n")


def merge_tables(other: str, path: str = KNOWN_FILE) -> list[str]:
    """Merge another recorded table (``known_apis.json`` written elsewhere) into ``path``; a
    release recorded in both must have the same shapes. Returns the releases of the result."""
    from packaging.version import Version

    tables = []
    for name in (path, other):
        with open(name, encoding="utf-8") as fh:
            tables.append(json.load(fh))
    apis: dict[str, dict[str, set[str]]] = {}
    for table in tables:
        for api, shapes in table["apis"].items():
            for sig, rels in shapes.items():
                apis.setdefault(api, {}).setdefault(sig, set()).update(rels)
    for api, shapes in apis.items():
        seen: dict[str, str] = {}
        for sig, rels in shapes.items():
            for rel in rels:
                if seen.setdefault(rel, sig) != sig:
                    raise ValueError(f"{api}: vLLM {rel} recorded as {seen[rel]} and as {sig}")
    releases = sorted({r for t in tables for r in t["releases"]}, key=Version)
    data = {"releases": releases,
            "apis": {api: {sig: sorted(rels, key=Version) for sig, rels in shapes.items()} for api, shapes in apis.items()}}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.write("\n")
    return releases


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m speculators_compat.check.inventory",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help="add the installed vLLM's shapes to the table")
    ap.add_argument("--root", help="read vLLM from this folder (an unpacked wheel's vllm/) instead")
    ap.add_argument("--release", help="the release name to record (default: the installed vLLM's base version)")
    ap.add_argument("--out", default=KNOWN_FILE)
    ap.add_argument("--merge", metavar="TABLE", help="merge a table recorded elsewhere into --out")
    args = ap.parse_args(argv)
    if args.merge:
        releases = merge_tables(args.merge, args.out)
        print(f"{args.out} now holds vLLM {', '.join(releases)}")
        return 0
    view = StaticView(vllm=Sources("vllm", args.root) if args.root else None, cpu=False)
    if args.record:
        from ..core import versions

        release = args.release or str(versions.vllm().base)
        merge(release, record(view), args.out)
        print(f"recorded vLLM {release} into {args.out}")
        return 0
    for e in inventory(view):
        print(f"{e['status']:<10} {e['api']}{e['found']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
