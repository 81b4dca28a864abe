"""What this session's full-shim scenario runs showed (a validation run, see tests/conftest.py)."""

from __future__ import annotations

RUN: dict = {"applied": set(), "models": set(), "tp": set(), "max_abs_diff": {}}


def note_run(report: dict, model: str, tp: int) -> None:
    """Add one full-shim scenario report to this session's validation run."""
    start = report.get("start", {})
    if not start.get("ok"):
        return
    RUN["applied"].update(start["value"]["applied"])
    for ids in start["value"].get("workers") or []:
        RUN["applied"].update(ids)
    RUN["models"].add(model)
    RUN["tp"].add(tp)
    diffs = [s["value"] for name, s in report.items()
             if name in ("mixed", "chunked", "prefix", "longseq") and s.get("ok") and isinstance(s.get("value"), float)]
    if diffs:
        RUN["max_abs_diff"][model] = max(RUN["max_abs_diff"].get(model, 0.0), *diffs)
