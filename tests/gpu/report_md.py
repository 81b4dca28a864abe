"""Turn the runner's results.json into the markdown of a "Verified on GPU" README section.

    python3 tests/gpu/report_md.py results.json [more results.json ...]  > section.md

Later files win for the same figure (e.g. call 3's results, then call 4's TP=2 results).
Prints what was measured and nothing else; the prose around it is the lead's.
"""

from __future__ import annotations

import json
import sys


def fmt(x, digits=3):
    if x is None:
        return "--"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def main(paths: list[str]) -> str:
    figures, tests, meta = {}, {}, {}
    for p in paths:
        data = json.loads(open(p).read())
        figures.update(data.get("figures", {}))
        for t in data.get("tests", []):
            tests[t["test"]] = t
        meta = {k: data.get(k) for k in ("date", "versions", "gpu")}
    v = meta.get("versions") or {}
    gpu = meta.get("gpu") or {}
    smi = gpu.get("nvidia_smi")
    smi = "; ".join(smi) if isinstance(smi, list) else (smi or "GPU ?")
    out = [f"Measured {meta.get('date')}: {smi}; "
           f"vLLM {v.get('vllm')}, torch {v.get('torch')}, transformers {v.get('transformers')}, "
           f"speculators {v.get('speculators')}, compressed-tensors {v.get('compressed-tensors')}, "
           f"Python {v.get('python')}.", ""]
    out += ["| test | outcome | seconds |", "| --- | --- | --- |"]
    for name, t in sorted(tests.items()):
        out.append(f"| `{name.split('::')[-1]}` | {t['outcome']} | {t['seconds']:.0f} |")
    out += ["", "| model | TP | set | sequences / tokens | max rel L2 (worst sequence) | pooled rel L2 | "
            "max abs | HF bf16 floor (worst seq.) | tokens/s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    backends = []
    for name, rep in sorted(figures.items()):
        if not name.startswith("extract_") or not isinstance(rep, dict):
            continue
        steps = rep.get("steps", {})
        model, tp = rep.get("model"), rep.get("tp")
        for s in ("mixed", "chunked", "long"):
            st = steps.get(s)
            if not st:
                continue
            if not st.get("ok"):
                out.append(f"| {model} | {tp} | {s} | failed: {st.get('error', '')[:120]} | | | | | |")
                continue
            val = st["value"]
            out.append(f"| {model} | {tp} | {s} | {val['sequences']} / {val['tokens']} | {fmt(val['max_rel_l2'])} | "
                       f"{fmt(val.get('pooled_rel_l2'))} | {fmt(val['max_abs'])} | "
                       f"{fmt((rep.get('floor_bf16') or {}).get(s))} | {val['tokens_per_s']} |")
        start = (steps.get("start") or {}).get("value") or {}
        w = (start.get("workers") or [{}])[0]
        backends.append(f"- {model} TP={tp}: attention {', '.join(w.get('attention', [])) or '?'}"
                        + (f"; MoE {', '.join(w.get('moe', []))}" if w.get("moe") else "")
                        + f"; KV cache (stock sizing) {(start.get('kv_cache') or {}).get('tokens')} tokens")
    out += ["", "Backends vLLM picked (read in the worker):", *backends]
    perf = (figures.get("perf") or {}).get("steps", {})
    if perf:
        rounds = (perf.get("rounds") or {}).get("value") or {}
        tps = rounds.get("tokens_per_s") or {}
        out += ["", "| mode | tokens/s (median) | best |", "| --- | --- | --- |"]
        out += [f"| {m} | {d['median']} | {d['best']} |" for m, d in tps.items()]
        out += ["", "Ratios (median / best): " + "; ".join(
            f"{k} {d['median']} / {d['best']}" for k, d in (rounds.get("ratios") or {}).items())]
        br = (rounds.get("breakdown") or {}).get("extract")
        if br:
            out += ["", "One extraction call, median seconds: " + ", ".join(f"{k} {fmt(v)}" for k, v in br.items())]
        long = (perf.get("long") or {}).get("value") or {}
        if long:
            on, off = long.get("offload", {}), long.get("no_offload", {})
            out += ["", f"Long call ({long.get('tokens')} tokens, {long.get('captured_gib')} GiB captured): peak device "
                        f"memory of the worker {on.get('worker_memory', {}).get('max_allocated_gib')} GiB with offload-captured, "
                        f"{off.get('worker_memory', {}).get('max_allocated_gib')} GiB without; {on.get('seconds')} s vs "
                        f"{off.get('seconds')} s."]
        start = (perf.get("start") or {}).get("value") or {}
        llm = (perf.get("llm") or {}).get("value") or {}
        out += [f"KV cache: generator (stock sizing) {start.get('kv_cache_tokens')} tokens; "
                + "; ".join(f"{m} {d.get('kv_cache_tokens')} tokens" for m, d in llm.items())]
        host = (perf.get("host") or {}).get("value")
        tr = (perf.get("transport") or {}).get("value")
        if host:
            out.append(f"Host, driver process ({host.get('torch_threads')} torch threads): clone {host.get('clone_gb_s')} GB/s, "
                       f"cat {host.get('cat_gb_s')} GB/s, pickle dumps {host.get('pickle_dumps_gb_s')} / loads "
                       f"{host.get('pickle_loads_gb_s')} GB/s.")
        if tr:
            out.append(f"collective_rpc transport of {tr['bytes'] / 1e9:.2f} GB: "
                       + ", ".join(f"{r['transport_gb_s']} GB/s" for r in tr["runs"]))
    unit = figures.get("offload_unit_cuda")
    if unit:
        out.append(f"Offload copy micro-test (16 steps of 2 x 64 MiB): work with async copies at "
                   f"{unit.get('async_vs_none')} of no-copy speed, with blocking .to('cpu') at {unit.get('blocking_vs_none')}.")
    return "\n".join(out)


if __name__ == "__main__":
    print(main(sys.argv[1:]))
