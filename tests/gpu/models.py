"""Random-weight models for the GPU runs, built where they run (no hub there).

Each builder writes a transformers checkpoint in bf16 (the dtype the GPU runs use, so vLLM's
``dtype="auto"`` and the fp32 HF reference start from the same weights) plus a locally
trained tokenizer (``speculators_compat.testing.tiny.build_tokenizer``).

* ``llama``  -- a small Llama (GQA, head_dim 64: FLASH_ATTN on Hopper).
* ``qwen3``  -- a small Qwen3 (GQA, q/k norms, head_dim 128 != hidden / heads).
* ``dsv3``   -- DeepSeek-V3 with the MLA dims Hopper's MLA kernels accept (kv_lora_rank 512 +
  qk_rope_head_dim 64 = 576; see tools/gpu/README.md), 1 dense + 3 MoE layers, 8 routed experts top-2
  + 1 shared, ``noaux_tc`` sigmoid routing with a correction bias.
* ``kimi``   -- the same architecture shaped like Kimi-K2-Thinking / Kimi-K2.5's text model
  (``n_group`` 1, ``topk_group`` 1, routed scaling 2.827) whose ROUTED experts are INT4 like
  the real checkpoint: compressed-tensors ``pack-quantized``, W4A16, symmetric int4, group
  size 32, ``ignore`` = lm_head, every ``self_attn``, the shared experts and the dense MLP
  (``re:.*mlp\\.(gate|up|gate_up|down)_proj.*``); quantized with the ``compressed-tensors``
  library. Its HF reference runs on the DEQUANTIZED weights (:func:`dequantized_state_dict`).
* ``perf``   -- a ~1.2B Llama (hidden 2048, 16 layers) for throughput and memory figures;
  ``G016_SMALL=1`` shrinks it (and nothing else) for CPU dry runs.

The builders import torch/transformers lazily; run ``python -m`` this file or call
:func:`build` to make them. Routing note: bf16 activations flip a few near-tied top-k
choices of the MoE routers; the GPU tests therefore also report HF's own bf16-vs-fp32
distance as the floor to compare with (see ``tests/gpu/common.py``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

#: the quantization_config of moonshotai/Kimi-K2-Thinking (Kimi-K2.5 adds
#: "re:.*vision_tower.*" and "re:.*mm_projector.*" to ``ignore`` for its vision tower)
KIMI_IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
]
KIMI_WEIGHTS = {
    "actorder": None,
    "block_structure": None,
    "dynamic": False,
    "group_size": 32,
    "num_bits": 4,
    "observer": "minmax",
    "observer_kwargs": {},
    "strategy": "group",
    "symmetric": True,
    "type": "int",
}

MODELS = ("llama", "qwen3", "dsv3", "kimi", "perf")


def _small() -> bool:
    return os.environ.get("G016_SMALL", "") not in ("", "0")


def _save(model, path: Path, vocab_size: int) -> None:
    import torch

    from speculators_compat.testing import tiny

    model.to(torch.bfloat16).save_pretrained(str(path), safe_serialization=True)
    tiny.build_tokenizer(path, vocab_size=min(vocab_size, 384))


def build_llama(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=512, vocab_size=512, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    from speculators_compat.testing import tiny

    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    tiny.randomize_final_norm(model)  # a row normed twice then shows (the self-check's faults)
    _save(model, path, config.vocab_size)


def build_qwen3(path: Path) -> None:
    """A small Qwen3: GQA, q/k norms, head_dim (128) != hidden / heads (64)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from speculators_compat.testing import tiny

    config = Qwen3Config(
        hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
        intermediate_size=512, vocab_size=512, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).float()
    tiny.randomize_final_norm(model)
    _save(model, path, config.vocab_size)


def dsv3_config(kimi: bool = False):
    from transformers import DeepseekV3Config

    h = 512
    config = DeepseekV3Config(
        vocab_size=512, hidden_size=h, intermediate_size=2 * h,
        moe_intermediate_size=h if kimi else h // 2,
        num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=1 if kimi else 2, topk_group=1,
        routed_scaling_factor=2.827 if kimi else 2.5, first_k_dense_replace=1, norm_topk_prob=True,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    config.topk_method = "noaux_tc"  # vLLM loads e_score_correction_bias only for noaux_tc
    config.scoring_func = "sigmoid"
    return config


def _dsv3_model(kimi: bool):
    import torch
    from transformers import DeepseekV3ForCausalLM

    config = dsv3_config(kimi)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).float()
    with torch.no_grad():  # a non-zero routing bias, so a test sees it used
        for layer in model.model.layers[config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    from speculators_compat.testing import tiny

    tiny.randomize_final_norm(model)  # a row normed twice then shows (the self-check's faults)
    return model


def build_dsv3(path: Path) -> None:
    model = _dsv3_model(kimi=False)
    _save(model, path, model.config.vocab_size)


def kimi_quantization_config() -> dict:
    return {
        "config_groups": {
            "group_0": {
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": dict(KIMI_WEIGHTS),
            }
        },
        "format": "pack-quantized",
        "ignore": list(KIMI_IGNORE),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def build_kimi(path: Path) -> dict:
    """Quantize the routed experts with compressed-tensors and save the compressed checkpoint.

    Steps: the bf16 model; ``apply_quantization_config`` (scales registered on exactly the
    modules the Kimi ``ignore`` list leaves: the routed experts); per-group min/max ->
    ``calculate_qparams`` (the library's symmetric int4 scale, stored in bf16 like the
    weights); ``ModelCompressor`` packs the int4 values (``weight_packed`` int32,
    ``weight_scale``, ``weight_shape``); ``update_config`` writes the quantization_config.
    Returns a summary (which modules were quantized)."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    from speculators_compat.testing import tiny

    model = _dsv3_model(kimi=True).to(torch.bfloat16)
    qcfg = kimi_quantization_config()
    qcfg["quantization_status"] = "initialized"
    config = QuantizationConfig.model_validate({k: v for k, v in qcfg.items() if k != "quant_method"})
    apply_quantization_config(model, config)
    args = QuantizationArgs.model_validate(KIMI_WEIGHTS)
    quantized = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            w = module.weight.float()
            groups = w.reshape(w.shape[0], -1, args.group_size)
            scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
            module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.zero_()
            quantized.append(name)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    if hasattr(model, "ct_decompress_hook"):
        compressor.remove_decompression_hook(model)
    model.save_pretrained(str(path), safe_serialization=True)
    compressor.update_config(str(path))
    # the library writes ``ignore`` as the expanded module names; write the checkpoint's
    # quantization_config exactly as Kimi's (regex ignore list), keeping the library version
    cfg_file = Path(path) / "config.json"
    cfg = json.loads(cfg_file.read_text())
    written = cfg["quantization_config"]
    cfg["quantization_config"] = dict(kimi_quantization_config(), version=written.get("version"))
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    tiny.build_tokenizer(path, vocab_size=384)
    summary = {"quantized_modules": len(quantized), "example": quantized[:3]}
    (Path(path) / "g016_quantized.json").write_text(
        json.dumps({"quantized": quantized, "library_ignore": written.get("ignore")}, indent=1)
    )
    return summary


def build_perf(path: Path) -> None:
    from transformers import LlamaConfig

    if _small():
        dims = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=4096)
    else:  # the 1.2B model of tools/gpu/capture_cost.py
        dims = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                    num_key_value_heads=8, vocab_size=32000)
    config = LlamaConfig(max_position_embeddings=32768, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False, **dims)
    from speculators_compat.testing import tiny

    tiny.save_random_llama(path, config, final_norm=False)


BUILDERS = {"llama": build_llama, "qwen3": build_qwen3, "dsv3": build_dsv3, "kimi": build_kimi, "perf": build_perf}


def build(root: str | Path, names=MODELS) -> dict:
    """Build the named models under ``root`` (skipping those already there); returns
    ``{name: "built" | "present" | "FAILED: ..."}``."""
    root = Path(root)
    out = {}
    for name in names:
        path = root / name
        if (path / "config.json").exists():
            out[name] = "present"
            continue
        path.mkdir(parents=True, exist_ok=True)
        try:
            extra = BUILDERS[name](path)
            out[name] = "built" + (f" {extra}" if extra else "")
        except Exception as exc:  # noqa: BLE001 - report which one failed and go on
            out[name] = f"FAILED: {type(exc).__name__}: {exc}"
            (path / "config.json").unlink(missing_ok=True)
        print(name, out[name], flush=True)
    return out


# -- the reference side of the INT4 checkpoint ------------------------------------------


def unpack_int4(packed, shape):
    """``weight_packed`` (int32, eight 4-bit values per word, low nibble first, offset 8)
    -> int8 values in [-8, 7] of ``shape``. Written here, independently of the library."""
    import torch

    rows, cols = int(shape[0]), int(shape[1])
    shifts = torch.arange(8, dtype=torch.int32) * 4
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF
    return (nibbles.reshape(rows, -1)[:, :cols] - 8).to(torch.int8)


def dequantized_state_dict(path: str | Path) -> dict:
    """The checkpoint's tensors with every packed weight replaced by ``q * scale`` (fp32)."""
    import glob

    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(glob.glob(str(Path(path) / "*.safetensors"))):
        tensors.update(load_file(f))
    out = {}
    for key, value in tensors.items():
        if key.endswith(".weight_packed"):
            base = key[: -len(".weight_packed")]
            q = unpack_int4(value, tensors[base + ".weight_shape"].tolist()).float()
            scale = tensors[base + ".weight_scale"].float()
            group = q.shape[1] // scale.shape[1]
            out[base + ".weight"] = q * scale.repeat_interleave(group, dim=1)
        elif key.endswith((".weight_scale", ".weight_shape", ".weight_zero_point")):
            continue
        else:
            out[key] = value.float()
    return out


def load_reference_model(path: str | Path, device: str = "cpu"):
    """The fp32 HF model of a checkpoint; for a compressed-tensors checkpoint, on its
    dequantized weights (the quantization_config is dropped from the config)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    if getattr(config, "quantization_config", None) is None:
        return AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).to(device).eval()
    del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    state = dequantized_state_dict(path)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not m.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"dequantized state dict does not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    # non-persistent buffers (rotary inv_freq) were created on meta: rebuild them
    for module in model.modules():
        if hasattr(module, "inv_freq") and module.inv_freq.is_meta:
            inv_freq, scaling = module.rope_init_fn(module.config, device="cpu")
            module.register_buffer("inv_freq", inv_freq, persistent=False)
            module.original_inv_freq = inv_freq
            module.attention_scaling = scaling
    return model.to(device).eval()


if __name__ == "__main__":
    names = sys.argv[2:] or MODELS
    print(json.dumps(build(sys.argv[1], names), indent=1))
