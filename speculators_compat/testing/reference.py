"""HF transformers fp32 references of the tiny models: the states the stock capture must match.

torch and transformers are imported inside the functions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .checkpoint import check_holds, dtype_keyword, model_layout, saved_tensors
from .kimi import deepseek_config

__all__ = ["hf_reference"]


def hf_reference(path: str | Path, token_ids: list[int], layer_ids: list[int]) -> list:
    """HF transformers fp32 states matching the stock capture of each layer id.

    Captured layer ``i`` is ``hidden_states + residual`` after decoder layer ``i``, i.e. HF's
    ``hidden_states[i + 1]``, except the last layer, which HF reports after the final norm:
    it is taken from a forward hook on the last decoder layer instead.
    """
    import torch

    model = _hf_model(str(path))
    last = {}
    handle = model.model.layers[-1].register_forward_hook(
        lambda m, a, out: last.__setitem__("h", out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.no_grad():
            out = model(torch.tensor([token_ids]), output_hidden_states=True)
    finally:
        handle.remove()
    n = model.config.num_hidden_layers
    return [(last["h"] if i == n - 1 else out.hidden_states[i + 1])[0].float() for i in sorted(set(layer_ids))]


_HF_CACHE: dict = {}


def _hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    if path not in _HF_CACHE:
        with open(os.path.join(path, "config.json")) as fh:
            model_type = json.load(fh).get("model_type")
        if model_type == "kimi_k25":
            _HF_CACHE[path] = _hf_kimi_language_model(path)
        else:
            model, info = AutoModelForCausalLM.from_pretrained(
                path, output_loading_info=True, **{dtype_keyword(): torch.float32})
            problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
            if problems:
                raise AssertionError(f"HF reference of {path}: {problems}")
            check_holds(model, saved_tensors(path), f"HF reference of {path}")
            _HF_CACHE[path] = model.eval()
    return _HF_CACHE[path]


def _hf_kimi_language_model(path: str):
    """HF transformers' ``DeepseekV3ForCausalLM`` (fp32) on a Kimi-K2.5 checkpoint's language-model
    weights: its ``text_config`` and the ``language_model.*`` tensors, loaded strictly."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    with open(os.path.join(path, "config.json")) as fh:
        text = json.load(fh)["text_config"]
    model = DeepseekV3ForCausalLM(deepseek_config(DeepseekV3Config, text)).to(torch.float32)
    weights = saved_tensors(path, "language_model.")
    model.load_state_dict(model_layout(model, weights), strict=True)
    check_holds(model, weights, f"HF reference of {path}")
    return model.eval()
