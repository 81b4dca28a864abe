"""``tox -e release``: the wheel and the sdist in DIR hold what an install needs, and nothing else.

``python -m build`` wrote them, ``twine check --strict`` checked their metadata; this checks their
contents: the patch set, the start-up hook, the data files, the entry points, the version, and
that every module the wheel ships is in the source (none left in ``build/lib`` by an earlier
build). ``check_release.py --plant ROOT`` (run before the build) leaves such a module in ROOT's
``build/lib``, as a build from before its removal would have: the build must not ship it.
"""

from __future__ import annotations

import sys
import tarfile
import zipfile
from pathlib import Path

NEEDED = [
    "speculators_compat/__init__.py",
    "speculators_compat/bootstrap/sitecustomize.py",
    "speculators_compat/check/validated.json",
    "speculators_compat/check/known_apis.json",
    "speculators_compat/check/supported.json",
    "speculators_compat/patches/__init__.py",
    "speculators_compat/patches/guards/guard_input.py",
    "speculators_compat/testing/remote_code/kimi_k25/configuration_kimi_k25.py",
]
ENTRY_POINTS = ["speculators-compat = speculators_compat.cli:main",
                "speculators_compat = speculators_compat.plugin:register"]


ROOT = Path(__file__).resolve().parent.parent
#: the module ``--plant`` leaves in build/lib: the source never has it
STALE = "speculators_compat/_removed_since_the_last_build.py"


def plant(root: str) -> int:
    """Leave :data:`STALE` in ``root``'s build/lib, as an earlier build of a removed module would."""
    stale = Path(root) / "build" / "lib" / STALE
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("# a module an earlier build copied here; the source has none of this name\n")
    return 0


def source_of(name: str) -> Path:
    """The source file a wheel's ``speculators_compat/...`` file is built from (setup.cfg's package_dir)."""
    inner = name.split("/", 1)[1]
    if inner.startswith("patches/"):
        return ROOT / inner
    return ROOT / name


def main(folder: str) -> int:
    sys.path.insert(0, str(ROOT))
    from speculators_compat import __version__

    wheels = sorted(Path(folder).glob("speculators_compat-*.whl"))
    sdists = sorted(Path(folder).glob("speculators_compat-*.tar.gz"))
    problems = []
    if [w.name for w in wheels] != [f"speculators_compat-{__version__}-py3-none-any.whl"]:
        problems.append(f"expected one wheel of version {__version__}, found {[w.name for w in wheels]}")
    if [s.name for s in sdists] != [f"speculators_compat-{__version__}.tar.gz"]:
        problems.append(f"expected one sdist of version {__version__}, found {[s.name for s in sdists]}")
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            names = set(zf.namelist())
            problems += [f"{wheel.name}: no {n}" for n in NEEDED if n not in names]
            entry = next((n for n in names if n.endswith(".dist-info/entry_points.txt")), None)
            text = zf.read(entry).decode() if entry else ""
            problems += [f"{wheel.name}: no entry point {e!r}" for e in ENTRY_POINTS if e not in text]
            problems += [f"{wheel.name}: ships {n}, which the source does not have (left in build/lib by an "
                         "earlier build)" for n in sorted(names)
                         if n.startswith("speculators_compat/") and not source_of(n).is_file()]
    for sdist in sdists:
        with tarfile.open(sdist) as tf:
            names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
        wanted = ["README.md", "setup.cfg", "setup.py", "pyproject.toml", "patches/__init__.py",
                  "speculators_compat/bootstrap/sitecustomize.py"]
        problems += [f"{sdist.name}: no {n}" for n in wanted if n not in names]
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        print(f"release {__version__}: {', '.join(p.name for p in wheels + sdists)} hold what an install needs")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(plant(sys.argv[2]) if sys.argv[1] == "--plant" else main(sys.argv[1]))
