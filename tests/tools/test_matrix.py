"""The matrix table drives tox.ini, the requirement files, the workflow and the table of docs/matrix.md."""

from __future__ import annotations

import re

import pytest

import matrix
from speculators_compat.check import validation


def test_generated_files_are_up_to_date():
    assert matrix.stale() == [], "run: python tools/matrix.py generate"


def test_every_environment_is_well_formed():
    from speculators_compat.testing import tiny

    data, envs = matrix.load()
    names = [e.name for e in envs]
    assert len(names) == len(set(names))
    for env in envs:
        # each model name is a tiny checkpoint: speculators_compat.testing.tiny.build_<name>
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


def test_merge_adds_a_run_and_replaces_only_the_same_days_run_of_its_environment(tmp_path):
    table = tmp_path / "validated.json"
    shapes = ["llama", "qwen3"]
    run = {"env": "e", "vllm": "0.16.0", "speculators": "0.3.0", "platform": "cpu", "models": shapes}
    first = matrix.write_run(str(tmp_path / "a"), {**run, "applied": ["x"], "date": "2026-12-01"})
    matrix.merge([first], str(table))
    again = matrix.write_run(str(tmp_path / "b"), {**run, "applied": ["y", "x"], "date": "2026-12-03"})
    matrix.merge([again], str(table))
    runs = validation.load.__wrapped__(str(table))["runs"]
    assert [r["applied"] for r in runs] == [["x"], ["x", "y"]]
    same_day = matrix.write_run(str(tmp_path / "c"), {**run, "applied": ["x", "y", "z"], "date": "2026-12-03"})
    matrix.merge([same_day], str(table))
    runs = validation.load.__wrapped__(str(table))["runs"]
    assert [r["applied"] for r in runs] == [["x"], ["x", "y", "z"]]
    assert validation.table({"runs": runs})["speculators"]["0.3"]["patches"]["z"]["vllm"] == ["0.16.0"]


def test_the_gpu_table_keeps_a_row_per_model_runner(tmp_path, monkeypatch):
    table = tmp_path / "validated.json"
    run = {"env": "gpu-h200", "vllm": "0.26.0", "speculators": "0.3.0", "platform": "cuda",
           "models": ["llama", "qwen3"], "transformers": "5.17.0"}
    v1 = matrix.write_run(str(tmp_path / "a"), {**run, "applied": ["runner-v1"], "date": "2026-12-03"})
    mrv2 = matrix.write_run(str(tmp_path / "b"), {**run, "applied": ["runner-v1", "mrv2-rows"], "date": "2026-12-05"})
    matrix.merge([v1, mrv2], str(table))
    monkeypatch.setattr(matrix, "VALIDATED", str(table))

    def runner_and_date():  # of each 0.26.0 row, in the table's order
        cells = [r.split(" | ") for r in matrix._gpu_table().splitlines() if r.startswith("| 0.26.0 ")]
        return [(c[3], c[7]) for c in cells]

    assert runner_and_date() == [("V1", "2026-12-03"), ("MRv2", "2026-12-05")]
    # a newer V1 run replaces the V1 row only
    again = matrix.write_run(str(tmp_path / "c"), {**run, "applied": ["runner-v1"], "date": "2026-12-06"})
    matrix.merge([again], str(table))
    assert runner_and_date() == [("V1", "2026-12-06"), ("MRv2", "2026-12-05")]


def test_record_takes_one_runs_file_beside_other_json(tmp_path, monkeypatch):
    table = tmp_path / "validated.json"
    monkeypatch.setattr(matrix, "VALIDATED", str(table))
    run = matrix.write_run(str(tmp_path / "out"), {"env": "gpu-h200", "vllm": "0.26.0", "speculators": "0.3.0",
                                                   "platform": "cuda", "applied": ["x"], "models": ["llama", "qwen3"]})
    (tmp_path / "out" / "results.json").write_text("{}")  # a GPU call's other output
    with pytest.raises(ValueError, match="needs 2 model shapes"):
        matrix.record(str(tmp_path / "out"))  # the folder: results.json is read as a run
    assert [r["vllm"] for r in matrix.record(run)] == ["0.26.0"]
    assert [r["vllm"] for r in validation.load.__wrapped__(str(table))["runs"]] == ["0.26.0"]


def test_a_run_on_one_model_shape_is_not_a_record(tmp_path):
    table = tmp_path / "validated.json"
    one = matrix.write_run(str(tmp_path / "a"), {"env": "e", "vllm": "0.19.0", "speculators": "0.4.0.1",
                                                      "platform": "cpu", "applied": ["x"], "models": ["llama"]})
    with pytest.raises(ValueError, match="needs 2 model shapes"):
        matrix.merge([one], str(table))
    assert not table.exists()


def test_the_workflow_is_one_job_template_over_every_environment():
    with open(matrix.WORKFLOW, encoding="utf-8") as fh:
        workflow = fh.read()
    _, envs = matrix.load()
    rows = [line.strip() for line in workflow.splitlines() if line.strip().startswith("- {env: ")]
    assert [row.split(",")[0].removeprefix("- {env: ") for row in rows] == ["unit", *(e.name for e in envs)]
    for env in envs:  # each environment's cache is keyed by the files that pin what it installs
        assert f"pins: tests/requirements/{env.name}.txt, overrides: tests/requirements/overrides-torch-{env.torch}.txt" in workflow
    assert "key: uv-${{ matrix.env }}-${{ hashFiles(matrix.pins, matrix.overrides) }}" in workflow
    assert workflow.count("runs-on:") == 3  # the template, the weekly check of the newest wheels, refresh
    # weekly: the newest vllm (CUDA) wheel read statically; every covered line resolved, per speculators line
    assert "- {package: vllm, python: " in workflow and "check --vllm-root /tmp/vllm" in workflow
    assert "python tools/unpack_wheel.py /tmp/wheel/*.whl /tmp/vllm" in workflow
    assert "python tools/matrix.py refresh --dry-run --strict --speculators ${{ matrix.speculators }}" in workflow
    for spec in ("0.3", "0.4"):
        mine = [e for e in envs if e.speculators.startswith(spec + ".")]
        assert f'- {{speculators: "{spec}", lines: "{matrix._lines_text(mine)}"}}' in workflow


def test_check_guards_every_generated_file():
    data, envs = matrix.load()
    requirements = {e.requirements for e in envs}
    requirements |= {matrix.os.path.join(matrix.REQUIREMENTS, f"overrides-torch-{t}.txt") for t in data["torch"]}
    assert set(matrix.outputs()) == {matrix.TOX, matrix.WORKFLOW, matrix.MATRIX_DOC, matrix.PATCHES_DOC,
                                     matrix.SUPPORTED, matrix.README} | requirements


def test_the_patch_list_of_the_docs_follows_the_declarations():
    import patchdoc

    from speculators_compat.core import hooks

    with open(matrix.PATCHES_DOC, encoding="utf-8") as fh:
        text = fh.read()
    listed = re.findall(r"^#### `([^`]+)`", text, re.M)
    from speculators_compat.core import preflight

    assert listed == [p.id for p in sorted(hooks.patches(), key=lambda p: _group_rank(p))] + preflight.ids()
    v6 = next(p for p in hooks.patches() if p.id == "v6")
    assert patchdoc.entry(v6) in text and v6.delta in patchdoc.entry(v6)
    # a changed declaration makes the file stale
    changed = patchdoc.document(text, [matrix_replace(p, title="changed") if p is v6 else p for p in hooks.patches()])
    assert changed != text and "#### `v6`: changed" in changed
    assert "## How a patch decides" in changed  # the hand-written prose stays


def _group_rank(patch):
    import patchdoc

    import speculators_compat.patches as patches

    return patches.GROUPS.index(patchdoc._group(patch))


def matrix_replace(patch, **changes):
    import dataclasses

    return dataclasses.replace(patch, **changes)
