"""Build the models and the HF fp32 references the GPU tests compare with (no vLLM needed).

    python tests/gpu/prepare.py [NAME ...]     (default: llama qwen3 dsv3 kimi perf)

Idempotent: what exists under $G016_ROOT (default /tmp/g016) is kept. Runs on the GPU
machine before vLLM has arrived (device call 1 or 2), and again, as a no-op or to fill gaps,
when the tests start. Writes $G016_ROOT/prepare.json (and refs/NAME.json per model: the
bf16 floor, timings; for the INT4 model also the check that HF transformers + compressed-
tensors decompress the checkpoint to exactly the weights the reference uses).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import models  # noqa: E402

REF_MODELS = ("llama", "qwen3", "dsv3", "kimi")


def kimi_hf_check(path) -> dict:
    """HF transformers loading the compressed checkpoint (compressed-tensors, decompressed on
    load) against our own dequantization: the largest weight difference."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    t = time.time()
    hf = AutoModelForCausalLM.from_pretrained(
        str(path), torch_dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)
    )
    ours = models.dequantized_state_dict(path)
    hf_sd = hf.state_dict()
    worst, compared, absent = 0.0, 0, []
    for name, value in ours.items():
        if name not in hf_sd:
            absent.append(name)
            continue
        worst = max(worst, (hf_sd[name].float() - value).abs().max().item())
        compared += 1
    return {"compared": compared, "max_abs_diff": worst, "absent_in_hf": absent[:5], "seconds": round(time.time() - t, 1)}


def prepare(names=None) -> dict:
    # G016_MODELS=llama,...: only those (a CPU dry run of one case)
    names = list(names or [n for n in os.environ.get("G016_MODELS", "").split(",") if n] or (*REF_MODELS, "perf"))
    out = {"build": {}, "refs": {}}
    t = time.time()
    out["build"] = models.build(common.MODELS, names)
    out["build_s"] = round(time.time() - t, 1)
    for name in names:
        if name not in REF_MODELS or not (common.MODELS / name / "config.json").exists():
            continue
        if (common.REFS / f"{name}.pt").exists():
            out["refs"][name] = json.loads((common.REFS / f"{name}.json").read_text())
            continue
        try:
            summary = common.compute_refs(name, floor=os.environ.get("G016_FLOOR", "1") != "0")
            if name == "kimi":
                try:
                    summary["hf_compressed_tensors_load"] = kimi_hf_check(common.MODELS / name)
                except Exception as exc:  # noqa: BLE001 - a figure, not a precondition
                    summary["hf_compressed_tensors_load"] = f"FAILED: {type(exc).__name__}: {exc}"
                (common.REFS / f"{name}.json").write_text(json.dumps(summary, indent=1))
            out["refs"][name] = summary
        except Exception as exc:  # noqa: BLE001
            out["refs"][name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        print(name, json.dumps(out["refs"][name])[:400], flush=True)
    out["seconds"] = round(time.time() - t, 1)
    common.ROOT.mkdir(parents=True, exist_ok=True)
    (common.ROOT / "prepare.json").write_text(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    result = prepare(sys.argv[1:])
    failed = [n for n, v in result["build"].items() if str(v).startswith("FAILED")]
    failed += [n for n, v in result["refs"].items() if isinstance(v, dict) and "error" in v]
    print("prepare:", "FAILED " + ", ".join(failed) if failed else "ok", f"({result['seconds']} s)")
    sys.exit(1 if failed else 0)
