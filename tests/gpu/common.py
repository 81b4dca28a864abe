"""What the GPU runs share: the prompt sets, the layers, the HF references, the metrics.

Everything here is deterministic (seeded), so the references computed in one process (or an
earlier device call) match the prompts the extraction sends in another. torch is imported
inside the functions.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

#: where the device runs keep their models and references (the device machine keeps /tmp
#: only while it stays warm: see tools/gpu/README.md)
ROOT = Path(os.environ.get("G016_ROOT", "/tmp/g016"))
MODELS = ROOT / "models"
REFS = ROOT / "refs"


def layers_for(num_layers: int) -> list[int]:
    """Every layer of a tiny model; the stock default [2, L/2, L-3, L-1] of a bigger one."""
    if num_layers <= 6:
        return sorted({0, 1, num_layers - 3, num_layers - 1} if num_layers > 4 else set(range(num_layers)))
    return sorted({2, num_layers // 2, num_layers - 3, num_layers - 1})


def num_layers(model_dir) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return cfg.get("num_hidden_layers") or cfg["text_config"]["num_hidden_layers"]


def prompt_sets(vocab: int = 512, seed: int = 1234) -> dict[str, list[list[int]]]:
    """``mixed``: 40 sequences of 1..600 tokens (more than the stock 32 sequences per step);
    ``chunked``: 5 x 2000 tokens, 10,000 in one call (more than the stock
    max_num_batched_tokens of 8192, so vLLM would split the last prompt if chunked prefill
    were on). With speculators 0.3.x a single sequence cannot exceed max_num_batched_tokens
    (= max(8192, max_model_len)); ``long`` is one sequence of 2047 tokens, the longest
    max_model_len 2048 admits."""
    rng = random.Random(seed)
    hi = min(vocab, 512) - 12
    lengths = [1, 2, 3, 17, 299, 300, 600] + [rng.randint(1, 600) for _ in range(33)]
    mixed = [[rng.randrange(3, hi) for _ in range(n)] for n in lengths]
    chunked = [[rng.randrange(3, hi) for _ in range(2000)] for _ in range(5)]
    long = [[rng.randrange(3, hi) for _ in range(2047)]]
    return {"mixed": mixed, "chunked": chunked, "long": long}


# -- HF references -----------------------------------------------------------------------


def hf_states(model, token_ids: list[int], layer_ids: list[int], device: str):
    """HF's ``hidden_states + residual`` after each requested decoder layer (what the stock
    capture records), as fp32 CPU tensors: forward hooks on the decoder layers, so the last
    layer is taken before the final norm."""
    import torch

    got = {}
    layers = model.model.layers
    handles = [
        layers[i].register_forward_hook(
            lambda m, a, out, i=i: got.__setitem__(i, (out[0] if isinstance(out, tuple) else out).detach())
        )
        for i in sorted(set(layer_ids))
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids], device=device))
    finally:
        for h in handles:
            h.remove()
    return [got[i][0].float().cpu() for i in sorted(set(layer_ids))]


def compute_refs(name: str, sets=("mixed", "chunked", "long"), device: str | None = None, floor: bool = True) -> dict:
    """fp32 HF states of every prompt of ``sets`` for model ``name`` (saved under REFS), and
    the bf16 floor: how far HF itself in bf16 lands from HF fp32 on the same prompts
    (max relative L2 / max abs per layer) -- the distance a correct bf16 engine is expected
    to show. Returns a summary."""
    import time

    import torch

    from models import load_reference_model  # tests/gpu/models.py (same folder on sys.path)

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # a true fp32 reference: no TF32 matmuls
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    path = MODELS / name
    layer_ids = layers_for(num_layers(path))
    prompts = prompt_sets()
    t0 = time.time()
    model = load_reference_model(path, device)
    out = {"layers": layer_ids, "sets": {}}
    summary = {"model": name, "layers": layer_ids, "device": device, "floor_bf16": {}}
    for s in sets:
        out["sets"][s] = [hf_states(model, ids, layer_ids, device) for ids in prompts[s]]
    summary["fp32_s"] = round(time.time() - t0, 1)
    if floor:
        t1 = time.time()
        model = model.to(torch.bfloat16)
        for s in sets:
            got = [hf_states(model, ids, layer_ids, device) for ids in prompts[s]]
            summary["floor_bf16"][s] = per_layer(compare_rows(got, out["sets"][s]), layer_ids)
        summary["bf16_s"] = round(time.time() - t1, 1)
    del model
    REFS.mkdir(parents=True, exist_ok=True)
    torch.save(out, REFS / f"{name}.pt")
    (REFS / f"{name}.json").write_text(json.dumps(summary, indent=1))
    return summary


def load_refs(name: str) -> dict:
    import torch

    return torch.load(REFS / f"{name}.pt", weights_only=False)


# -- metrics -----------------------------------------------------------------------------


#: a row (one token's state) whose own relative L2 exceeds this counts as an outlier row:
#: with bf16 activations MoE routers flip near-tied top-k choices for a few tokens
ROW_OUTLIER = 0.05


def compare_rows(got: list[list], want: list[list]) -> list[list[dict]]:
    """Per sequence, per layer: relative L2, max abs difference, squared sums (for the pooled
    relative L2 of a whole set) and the rows whose own relative L2 exceeds ROW_OUTLIER."""
    if len(got) != len(want):
        raise AssertionError(f"{len(got)} results for {len(want)} sequences")
    out = []
    for i, (g_layers, w_layers) in enumerate(zip(got, want)):
        if len(g_layers) != len(w_layers):
            raise AssertionError(f"sequence {i}: {len(g_layers)} layers, expected {len(w_layers)}")
        row = []
        for g, w in zip(g_layers, w_layers):
            g = g.float().cpu()
            if tuple(g.shape) != tuple(w.shape):
                raise AssertionError(f"sequence {i}: shape {tuple(g.shape)} != {tuple(w.shape)}")
            diff = g - w
            row_rel = diff.norm(dim=-1) / w.norm(dim=-1).clamp_min(1e-30)
            row.append({
                "rel_l2": (diff.norm() / w.norm().clamp_min(1e-30)).item(),
                "max_abs": diff.abs().max().item(),
                "ref_max": w.abs().max().item(),
                "diff_sq": float(diff.double().pow(2).sum()),
                "ref_sq": float(w.double().pow(2).sum()),
                "outlier_rows": int((row_rel > ROW_OUTLIER).sum()),
                "rows": int(w.shape[0]),
            })
        out.append(row)
    return out


def per_layer(rows: list[list[dict]], layer_ids: list[int]) -> dict:
    """Aggregate :func:`compare_rows` per layer: the worst sequence's relative L2, the median
    one, the pooled relative L2 over every row of the set, the max abs diff, and how many
    rows are outliers (own relative L2 > ROW_OUTLIER)."""
    import math
    import statistics

    out = {}
    for j, layer in enumerate(layer_ids):
        rel = [r[j]["rel_l2"] for r in rows]
        out[str(layer)] = {
            "max_rel_l2": max(rel),
            "median_rel_l2": statistics.median(rel),
            "pooled_rel_l2": math.sqrt(sum(r[j]["diff_sq"] for r in rows) / max(sum(r[j]["ref_sq"] for r in rows), 1e-30)),
            "max_abs": max(r[j]["max_abs"] for r in rows),
            "ref_max": max(r[j]["ref_max"] for r in rows),
            "outlier_rows": sum(r[j]["outlier_rows"] for r in rows),
            "rows": sum(r[j]["rows"] for r in rows),
        }
    return out


def worst(layers: dict, key: str = "max_rel_l2") -> float:
    return max(v[key] for v in layers.values())
