"""Unit tests of ``speculators-compat verify`` and of the archive reader behind it (no vLLM; torch
only where installed, to read torch's own archives): folders written with ``tests/fake_pt.py``,
complete, then with a hole, a duplicate, a truncated file and the other findings."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fake_pt
import matrix
from speculators_compat.run import ptfile, verify

# no vLLM needed: the unit tests and the full suites run them, not every release of the matrix
pytestmark = matrix.suite_is("full")

N = 12


def folder(tmp_path: Path, n: int = N, config: bool = True) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    for i in range(n):
        fake_pt.save(fake_pt.sample(3 + i, seed=i), out / f"data_{i}.pt")
    if config:
        (out / "data_config.json").write_text(json.dumps({
            "data": {"num_samples": n}, "hidden_states": {"layer_ids": [2, 5, 9]}, "model": {"hidden_size": 4}}))
    return out


def kinds(report) -> set[tuple[str, int | None]]:
    return {(f.kind, f.index) for f in report.findings}


def test_the_reader_returns_shapes_and_dtypes_without_the_data(tmp_path):
    path = tmp_path / "data_0.pt"
    fake_pt.save(fake_pt.sample(5), path)
    meta = ptfile.read(path)
    assert meta["input_ids"] == ptfile.TensorMeta("int64", (5,), (1,), 0, "0")
    assert [h.describe() for h in meta["hidden_states"]] == ["[5, 4] float32"] * 3
    blob = path.read_bytes()
    path.write_bytes(blob[:-40])
    with pytest.raises(ptfile.BadArchive, match="not a complete torch.save archive"):
        ptfile.read(path)


def test_the_reader_agrees_with_torch(tmp_path):
    torch = pytest.importorskip("torch")
    x = torch.randn(10, 16)
    saved = {"input_ids": torch.arange(10), "hidden_states": [x, x[2:5].to(torch.bfloat16), x.t(), x[:, 3]],
             "loss_mask": torch.ones(10, dtype=torch.long)[:7], "f16": torch.zeros(2, 3, dtype=torch.float16),
             "u16": torch.zeros(4, dtype=torch.uint16)}
    path = tmp_path / "data_0.pt"
    torch.save(saved, path)
    meta = ptfile.read(path)
    for got, want in zip(meta["hidden_states"] + [meta["input_ids"], meta["loss_mask"], meta["f16"], meta["u16"]],
                         saved["hidden_states"] + [saved["input_ids"], saved["loss_mask"], saved["f16"], saved["u16"]]):
        assert (got.dtype, got.shape, got.stride, got.offset) == (
            str(want.dtype).removeprefix("torch."), tuple(want.shape), want.stride(), want.storage_offset())
    torch.save({"model": torch.nn.Linear(2, 2)}, path)
    with pytest.raises(ptfile.BadArchive, match="not plain tensors"):
        ptfile.read(path)


def test_a_complete_folder_passes(tmp_path):
    out = folder(tmp_path)
    report = verify.verify(out)
    assert report.complete, verify.render(report)
    assert report.expected == N and report.expected_from == ["data_config.json"]
    assert report.geometry["layers"] == 3 and report.geometry["states_dtype"] == "float32"
    assert verify.render(report).endswith("complete: yes")


def test_a_hole_a_duplicate_and_a_truncated_file_are_named_by_index(tmp_path):
    out = folder(tmp_path)
    (out / "data_4.pt").unlink()
    shutil.copy(out / "data_7.pt", out / "data_07.pt")  # the stock resume reads it as 7
    (out / "nested").mkdir()
    shutil.copy(out / "data_2.pt", out / "nested" / "data_2.pt")  # the trainer loads it too
    blob = (out / "data_9.pt").read_bytes()
    (out / "data_9.pt").write_bytes(blob[: len(blob) // 2])
    report = verify.verify(out)
    assert kinds(report) == {("hole", 4), ("duplicate", 7), ("duplicate", 2), ("unreadable", 9)}
    text = verify.render(report)
    assert "hole        data_4.pt: index 4 missing" in text
    assert "duplicate   data_7.pt: index 7 is also in data_07.pt" in text
    assert "duplicate   data_2.pt: index 2 is also in nested/data_2.pt" in text
    assert "unreadable  data_9.pt: not a complete torch.save archive" in text
    assert text.endswith("complete: NO (2 duplicate, 1 hole, 1 unreadable)")
    proc = subprocess.run([sys.executable, "-m", "speculators_compat.run.verify", str(out), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and json.loads(proc.stdout)["complete"] is False
    proc = subprocess.run([sys.executable, "-m", "speculators_compat.cli", "verify", str(tmp_path / "nowhere")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no such folder" in proc.stderr


def test_strays_mismatches_and_records_that_disagree(tmp_path):
    out = folder(tmp_path)
    fake_pt.save(fake_pt.sample(3), out / "data_12.pt")  # beyond the 12 samples
    fake_pt.save(fake_pt.sample(3), out / "token_freq.pt")  # the trainer would load it as a sample
    (out / ".data_5.pt.x7.tmp").write_bytes(b"")
    fake_pt.save(fake_pt.sample(8, layers=2, seed=3), out / "data_3.pt")
    fake_pt.save(fake_pt.sample(9, seed=6, dtype="bfloat16"), out / "data_6.pt")
    bad = fake_pt.sample(10, seed=8)
    bad["loss_mask"] = fake_pt.Tensor("int64", (9,), [1] * 9)
    fake_pt.save(bad, out / "data_8.pt")
    (out / "sample_lengths.json").write_text(json.dumps({str(i): 3 + i for i in range(N)} | {"1": 99}))
    (out / "shards.json").write_text(json.dumps({"dataset_length": 13, "shards": 2}))
    report = verify.verify(out)
    found = kinds(report)
    assert {("stray", 12), ("stray", None), ("mismatch", 3), ("mismatch", 6), ("mismatch", 8), ("mismatch", 1),
            ("config", None)} <= found, verify.render(report)
    text = verify.render(report)
    assert "layers 2 (the folder's: 3)" in text and "states_dtype bfloat16 (the folder's: float32)" in text
    assert "loss_mask is [9] int64, input_ids has 10 tokens" in text
    assert "sample_lengths.json lists 99 tokens, the file holds 4" in text
    assert "the dataset's length differs: 12 (data_config.json), 13 (shards.json)" in text
    assert "token_freq.pt: not a data_<i>.pt sample" in text and ".data_5.pt.x7.tmp: temporary file" in text


def test_without_a_config_the_run_is_not_finished(tmp_path):
    out = folder(tmp_path, config=False)
    report = verify.verify(out)
    assert not report.complete and report.expected is None
    text = verify.render(report)
    assert "data_config.json: missing" in text and "the dataset's length is unknown" in text
    report = verify.verify(out, expect=14)
    assert ("hole", 12) in kinds(report) and "indices 12 .. 13 missing (2)" in verify.render(report)
