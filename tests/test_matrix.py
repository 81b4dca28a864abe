"""The matrix table drives tox.ini, the requirement files, the workflow and the README table."""

from __future__ import annotations

import matrix


def test_generated_files_are_up_to_date():
    assert matrix.stale() == [], "run: python tests/matrix.py generate"


def test_every_environment_is_well_formed():
    from speculators_compat import tiny

    data, envs = matrix.load()
    names = [e.name for e in envs]
    assert len(names) == len(set(names))
    for env in envs:
        # each model name is a tiny checkpoint: speculators_compat.tiny.build_<name>
        assert env.models and all(hasattr(tiny, f"build_{m}") for m in env.models), env.name
        assert env.torch in data["torch"], env.name
    ci = [e for e in envs if e.ci]
    # CI runs at least the full vLLM 0.16 suite
    assert any(e.suite == "full" and e.base == "0.16.0" for e in ci)


def test_the_ci_label_is_what_ci_runs():
    with open(matrix.TOX, encoding="utf-8") as fh:
        tox = fh.read()
    _, envs = matrix.load()
    for env in envs:
        section = tox[tox.index(f"[testenv:{env.name}]\n"):].split("\n\n", 1)[0]
        assert ("labels = matrix, ci" in section) == env.ci, env.name
    with open(matrix.os.path.join(matrix.ROOT, ".ci", "run"), encoding="utf-8") as fh:
        assert "tox -m ci" in fh.read()
