"""``python -m speculators_compat.check``: which patches apply to this install, and why.

Prints the installed Python, torch, vLLM and speculators versions, then every patch with
its status (applies / not needed / refused / disabled), grouped by the side it runs on
(driver: the generator process; worker: every vLLM worker), and the evidence.

To evaluate the feature probes, the check imports the speculators modules the patches
target (and thereby vLLM): a few seconds.

Exit codes: 0 -- covered (no patch refused); 1 -- not covered (at least one refusal, or
speculators/vLLM missing); 2 -- the check itself failed.

``--json`` prints one object::

    {"python": str, "torch": str|null, "vllm": {"distribution", "version", "kind"}|null,
     "speculators": str|null, "covered": bool,
     "patches": [{"id", "title", "side", "kind", "delta", "target", "vllm_validated",
                  "speculators", "status", "reason"}]}
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


def report() -> dict:
    from . import hooks

    hooks.install()
    decisions = hooks.status(import_targets=True)
    vllm = versions.vllm()
    spec = versions.speculators()
    torch = versions.installed("torch")
    covered = (
        vllm is not None
        and spec is not None
        and not any(d.status in (Status.REFUSED, Status.PENDING) for d in decisions)
    )
    return {
        "python": platform.python_version(),
        "torch": str(torch.version) if torch else None,
        "vllm": (
            {"distribution": vllm.distribution, "version": str(vllm.version), "kind": vllm.kind}
            if vllm
            else None
        ),
        "speculators": str(spec.version) if spec else None,
        "covered": covered,
        "patches": [d.as_dict() for d in decisions],
    }


def _text(rep: dict) -> str:
    v = rep["vllm"]
    lines = [
        f"Python       {rep['python']}",
        f"torch        {rep['torch'] or 'not installed'}",
        f"vLLM         {v['distribution'] + ' ' + v['version'] + ' (' + v['kind'] + ')' if v else 'not installed'}",
        f"speculators  {rep['speculators'] or 'not installed'}",
    ]
    for side, title in (("driver", "driver-side patches (generator process)"), ("worker", "worker-side patches (every vLLM worker)")):
        lines.append("")
        lines.append(title + ":")
        for p in rep["patches"]:
            if p["side"] == side:
                lines.append(f"  {p['id']:<19} {p['status']:<11} {p['reason']}")
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
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        with _stdout_to_stderr():
            rep = report()
    except Exception as exc:  # the check must say what broke, not crash with a trace
        print(f"speculators_compat check failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(rep, indent=2) if args.json else _text(rep))
    return 0 if rep["covered"] else 1


if __name__ == "__main__":
    sys.exit(main())
