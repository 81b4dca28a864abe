"""docs/results holds only the records something cites, and every cited record is there.

A citation is a ``results/NAME`` path in the docs, README, CHANGELOG, the validation data
(``speculators_compat/check/*.json``), benchmarks/, tox.ini or the tests; ``NAME`` may use shell
braces (``{1b,8b}``) and globs (``*``). Older raw results are in git history."""

from __future__ import annotations

import fnmatch
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
CITE = re.compile(r"results/([A-Za-z0-9_.*{},-]+\.json)")
SOURCES = ("README.md", "CHANGELOG.md", "tox.ini", "docs/*.md", "speculators_compat/check/*.json",
           "benchmarks/**/*.py", "tests/**/*.py", "tests/**/*.md", "tests/**/*.sh")


def expand(pattern: str) -> list[str]:
    """Shell brace expansion, innermost-first is not needed: the docs use flat braces."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m.group(1).split(",")
            for x in expand(pattern[:m.start()] + alt + pattern[m.end():])]


def citations(root: pathlib.Path) -> dict[str, str]:
    """Each cited pattern -> the first file citing it."""
    cited: dict[str, str] = {}
    for glob in SOURCES:
        for path in sorted(root.glob(glob)):
            if RESULTS in path.parents or path == pathlib.Path(__file__).resolve():
                continue
            for m in CITE.finditer(path.read_text(encoding="utf-8", errors="replace")):
                for pat in expand(m.group(1)):
                    cited.setdefault(pat, str(path.relative_to(root)))
    return cited


def audit(root: pathlib.Path, results: pathlib.Path) -> tuple[list[str], list[str]]:
    """(files nothing cites, citations that match no file)."""
    names = sorted(p.name for p in results.glob("*.json"))
    cited = citations(root)
    stray = [n for n in names if not any(fnmatch.fnmatchcase(n, pat) for pat in cited)]
    missing = [f"{pat} (cited by {src})" for pat, src in cited.items()
               if not any(fnmatch.fnmatchcase(n, pat) for n in names)]
    return stray, missing


def test_results_are_cited_and_present():
    stray, missing = audit(ROOT, RESULTS)
    assert not stray, f"docs/results holds files nothing cites (git history keeps them): {stray}"
    assert not missing, f"cited results that docs/results lacks: {missing}"


def test_audit_catches_a_stray_and_a_missing_file(tmp_path):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "a.md").write_text("see results/run-{1,2}.json and results/gone.json\n")
    for name in ("run-1.json", "run-2.json", "stray.json"):
        (tmp_path / "docs" / "results" / name).write_text("{}")
    stray, missing = audit(tmp_path, tmp_path / "docs" / "results")
    assert stray == ["stray.json"]
    assert missing == ["gone.json (cited by docs/a.md)"]
