"""The V1 runner and Model Runner V2 on one release, one model: the same rows?

    python tests/gpu/runners.py OUT.json V1_REPORT.json MRV2_REPORT.json

Merges two ``tests/gpu/extract.py`` reports of one model (the first run under the V1 runner with
``--save-rows``, the second under Model Runner V2 with ``--compare-rows``) into one, with
``problems``: every failed criterion (empty: passed). Criteria: each run built the runner it was
asked for in every worker (and ``mrv2-rows`` applied there under MRv2); every set's rows ==
tokens in both; MRv2's rows against V1's no further apart than twice V1's own distance to HF fp32
(0.01 at least: a row of another sequence is ~1.0 away); MRv2 against HF fp32 within 1.25x V1's
(+0.005). Exit status 1 when a criterion failed.
"""

from __future__ import annotations

import json
import sys

V1 = ("vllm.v1.worker.gpu_model_runner.", "vllm.v1.worker.cpu_model_runner.")
MRV2 = "vllm.v1.worker.gpu.model_runner."


def _workers(report: dict) -> list[dict]:
    return ((report.get("steps", {}).get("start") or {}).get("value") or {}).get("workers") or []


def runner_problems(report: dict, which: str) -> list[str]:
    """Whether every worker of ``report`` built the runner ``which`` (v1 | mrv2) names."""
    start = report.get("steps", {}).get("start") or {}
    if not start.get("ok"):
        return [f"{which}: start failed: {start.get('error', 'no start step')[:300]}"]
    out = []
    for i, w in enumerate(_workers(report) or [{}]):
        runner = str(w.get("model_runner"))
        if not runner.startswith(V1 if which == "v1" else MRV2):
            out.append(f"{which}: worker {i} built {runner}")
        if which == "mrv2" and "mrv2-rows" not in (w.get("applied") or []):
            out.append(f"mrv2: worker {i}: mrv2-rows not applied: {w.get('applied')}")
    return out


def set_problems(name: str, v1: dict, mrv2: dict) -> list[str]:
    """One prompt set's criteria (``v1``/``mrv2``: the set's step of each report)."""
    if not (v1.get("ok") and mrv2.get("ok")):
        return [f"{name}: a run failed: v1 {v1.get('error', '')[:200]!r}, mrv2 {mrv2.get('error', '')[:200]!r}"]
    a, b = v1["value"], mrv2["value"]
    out = []
    if not (a.get("rows_ok") and b.get("rows_ok")):
        out.append(f"{name}: rows != tokens (v1 {a.get('rows_ok')}, mrv2 {b.get('rows_ok')})")
    vs = b.get("vs_saved") or {}
    if "max_rel_l2" not in vs:
        return out + [f"{name}: MRv2's rows were not compared with V1's"]
    if vs["max_rel_l2"] > max(2 * a["max_rel_l2"], 0.01):
        out.append(f"{name}: MRv2 vs V1 rel. L2 {vs['max_rel_l2']:.4g} > max(2 x V1 vs HF {a['max_rel_l2']:.4g}, 0.01)")
    if b["max_rel_l2"] > 1.25 * a["max_rel_l2"] + 0.005:
        out.append(f"{name}: MRv2 vs HF {b['max_rel_l2']:.4g} > 1.25 x V1 vs HF {a['max_rel_l2']:.4g} + 0.005")
    return out


def merge(v1: dict, mrv2: dict) -> dict:
    problems = runner_problems(v1, "v1") + runner_problems(mrv2, "mrv2")
    sets = {}
    for name, step in v1.get("steps", {}).items():
        if name in ("start", "repeat"):
            continue
        other = mrv2.get("steps", {}).get(name, {})
        problems += set_problems(name, step, other)
        pick = ("max_rel_l2", "pooled_rel_l2", "max_abs", "tokens", "seconds", "rows_ok", "first_step_early")
        sets[name] = {"v1": {k: (step.get("value") or {}).get(k) for k in pick},
                      "mrv2": {k: (other.get("value") or {}).get(k) for k in pick},
                      "mrv2_vs_v1": (other.get("value") or {}).get("vs_saved")}
    return {"model": v1.get("model"), "versions": v1.get("versions") or mrv2.get("versions"),
            "env": {"v1": v1.get("env"), "mrv2": mrv2.get("env")},
            "runners": {"v1": [w.get("model_runner") for w in _workers(v1)],
                        "mrv2": [w.get("model_runner") for w in _workers(mrv2)]},
            "applied": {"v1": [w.get("applied") for w in _workers(v1)],
                        "mrv2": [w.get("applied") for w in _workers(mrv2)]},
            "sets": sets, "problems": problems}


def main(argv: list[str]) -> int:
    out, v1_path, mrv2_path = argv
    reports = []
    for path in (v1_path, mrv2_path):
        try:
            with open(path, encoding="utf-8") as fh:
                reports.append(json.load(fh))
        except (OSError, ValueError) as exc:
            reports.append({"steps": {"start": {"ok": False, "error": f"{path}: {exc}"}}})
    merged = merge(*reports)
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(merged, fh, indent=1)
    print(f"runners {merged['model']}: " + ("ok" if not merged["problems"] else "; ".join(merged["problems"])[:1500]))
    for name, s in merged["sets"].items():
        print(f"  {name}: v1 vs HF {s['v1']['max_rel_l2']}, mrv2 vs HF {s['mrv2']['max_rel_l2']}, "
              f"mrv2 vs v1 {s['mrv2_vs_v1']}")
    return 1 if merged["problems"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
