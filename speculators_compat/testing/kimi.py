"""A tiny checkpoint shaped like moonshotai/Kimi-K2.5, with its remote code and tokenizer.

torch and transformers are imported inside the functions.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .checkpoint import randomize_final_norm, save_hub_layout

__all__ = ["KIMI_K25_REMOTE_CODE", "KIMI_SPECIAL_TOKENS", "KIMI_MEDIA_PROC_CFG", "build_kimi_tokenizer",
           "build_kimi_k25", "deepseek_config"]


#: the remote code the tiny Kimi-K2.5 checkpoint ships (stand-ins for the real checkpoint's files)
KIMI_K25_REMOTE_CODE = Path(__file__).parent / "remote_code" / "kimi_k25"

#: Kimi's special tokens at their offsets after the base vocabulary (163584 in moonshotai/Kimi-K2.5):
#: bos 163584, eos 163585, media_placeholder_token_id 163605 and pad 163839 are the real config's
#: ids; the names [UNK]/[PAD] and the [UNK] offset are assumed. The other special ids are reserved.
KIMI_SPECIAL_TOKENS = {0: "[BOS]", 1: "[EOS]", 21: "<|media_pad|>", 254: "[UNK]", 255: "[PAD]"}

#: the real checkpoint's media processing settings; the tiny one lowers the patch limits (real:
#: 16384, 4096 and 512), so vLLM's profiling image (3000 x 3000) becomes 1024 patches, not 16384
KIMI_MEDIA_PROC_CFG = {
    "in_patch_limit": 1024,
    "patch_size": 14,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2,
    "fixed_output_tokens": None,
    "patch_limit_on_one_side": 64,
    "in_patch_limit_each_frame": 256,
    "in_patch_limit_video": None,
    "sample_fps": 2.0,
    "max_num_frames_each_video": None,
    "temporal_merge_kernel_size": 4,
    "timestamp_mode": "hh:mm:ss.fff",
}


def build_kimi_tokenizer(path: str | Path, num_special: int = 256) -> dict[str, int]:
    """A tokenizer laid out like Kimi's: ``tiktoken.model`` (here the 256 byte tokens, no merges)
    plus ``num_special`` special ids after it, loaded by the ``tokenization_kimi.py`` remote code
    through ``tokenizer_config.json``'s ``auto_map`` (no ``tokenizer.json``). Returns the ids of
    the named special tokens."""
    import base64

    path = Path(path)
    base = 256
    with open(path / "tiktoken.model", "w") as fh:
        for i in range(base):
            fh.write(f"{base64.b64encode(bytes([i])).decode()} {i}\n")
    names = {offset: name for offset, name in KIMI_SPECIAL_TOKENS.items() if offset < num_special}
    decoder = {
        str(base + offset): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": True}
        for offset, name in sorted(names.items())
    }
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "num_reserved_special_tokens": num_special,
        "added_tokens_decoder": decoder,
        "model_max_length": 1048576,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copy(KIMI_K25_REMOTE_CODE / "tokenization_kimi.py", path / "tokenization_kimi.py")
    return {name: base + offset for offset, name in names.items()}


def build_kimi_k25(
    path: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 7,
    num_heads: int = 4,
    vision_hidden_size: int = 32,
    vision_layers: int = 2,
    vision_heads: int = 2,
    q_lora_rank: int | None = 64,
    seed: int = 0,
) -> Path:
    """A random-weight checkpoint shaped like moonshotai/Kimi-K2.5, saved in fp32.

    ``config.json``: model type ``kimi_k25``, architecture ``KimiK25ForConditionalGeneration``, a
    DeepSeek-V3 ``text_config`` (MLA dimensions, a dense first layer then MoE layers with routed
    and shared experts, ``noaux_tc`` sigmoid routing with a non-zero correction bias, YaRN rotary
    scaling as in the real one) and a MoonViT ``vision_config`` with a patch-merger projector;
    the layer count only in ``text_config``. The weights carry the real checkpoint's names
    (``language_model.model.*``, ``language_model.lm_head.weight``, ``vision_tower.*``,
    ``mm_projector.{pre_norm,proj.0,proj.2}.*``).

    Like the real checkpoint it needs its remote code, shipped here as minimal local equivalents
    (``speculators_compat/testing/remote_code/kimi_k25``): ``configuration_kimi_k25.py`` (``auto_map``
    of config.json), ``kimi_k25_vision_processing.py`` (``auto_map`` of preprocessor_config.json,
    loaded by vLLM's Kimi-K2.5 processing) and ``tokenization_kimi.py`` (a tiktoken tokenizer,
    ``auto_map`` of tokenizer_config.json). The vision tower's size is written twice: as the
    real checkpoint spells it (``vt_hidden_size``, ...) and as vLLM 0.15/0.16's own
    ``KimiK25VisionConfig`` reads it (``hidden_size``, ...; for the real checkpoint vLLM falls
    back to its defaults, which are the real sizes). The non-MLA head size used on the CPU,
    ``qk_nope_head_dim + qk_rope_head_dim`` = 64, is one vLLM's CPU attention supports.
    ``rms_norm_eps`` is 1e-6, not Kimi-K2.5's 1e-5 (see the comment at the value), and
    ``q_lora_rank=None`` gives a ``q_proj`` instead of the q LoRA (what vLLM 0.15's loader
    needs on the CPU, where attention is not MLA).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    special = build_kimi_tokenizer(path)
    text = _kimi_text_config(special, hidden_size, num_layers, num_heads, q_lora_rank)
    vision = _kimi_vision_config(hidden_size, vision_hidden_size, vision_layers, vision_heads)
    _write_kimi_files(path, _kimi_config(special, text, vision))
    _save_kimi_weights(path, text, vision, seed)
    return path


def _kimi_text_config(special: dict, hidden_size: int, num_layers: int, num_heads: int,
                      q_lora_rank: int | None) -> dict:
    """The ``text_config``: DeepSeek-V3 with MLA, a dense first layer then MoE layers, ``noaux_tc``
    sigmoid routing, YaRN rotary scaling."""
    vocab_size = 512
    text = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "moe_intermediate_size": hidden_size // 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads,
        "n_shared_experts": 1,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "routed_scaling_factor": 2.827,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32,
        "v_head_dim": 32,
        "hidden_act": "silu",
        # Kimi-K2.5 has 1e-5; vLLM applies it to the MLA q_a/kv_a norms too, while transformers'
        # DeepseekV3 (and DeepSeek's reference code) keep 1e-6 there (transformers#44261,
        # vLLM#35515). 1e-6 makes both read the same model, so the comparison tests the capture
        # (with 1e-5: 9e-6 at layer 0 and a flipped MoE route)
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "max_position_embeddings": 262144,
        "attention_bias": False,
        "num_nextn_predict_layers": 0,
        "bos_token_id": special["[BOS]"],
        "eos_token_id": special["[EOS]"],
        "pad_token_id": special["[PAD]"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    return text


def _kimi_vision_config(hidden_size: int, vision_hidden_size: int, vision_layers: int, vision_heads: int) -> dict:
    """The MoonViT ``vision_config`` with a patch-merger projector."""
    merge = [2, 2]
    vision = {
        "patch_size": 14,
        "init_pos_emb_height": 16,
        "init_pos_emb_width": 16,
        "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed",
        "vt_hidden_size": vision_hidden_size,
        "vt_num_hidden_layers": vision_layers,
        "vt_num_attention_heads": vision_heads,
        "vt_intermediate_size": 2 * vision_hidden_size,
        "merge_kernel_size": merge,
        "video_attn_type": "spatial_temporal",
        "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmerger",
        "mm_hidden_size": vision_hidden_size,
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
        "text_hidden_size": hidden_size,
        # the same sizes as vLLM's own KimiK25VisionConfig (0.15, 0.16) reads them
        "hidden_size": vision_hidden_size,
        "num_hidden_layers": vision_layers,
        "num_attention_heads": vision_heads,
        "intermediate_size": 2 * vision_hidden_size,
    }
    return vision


def _kimi_config(special: dict, text: dict, vision: dict) -> dict:
    """``config.json``: the ``kimi_k25`` model with its remote-code ``auto_map``."""
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
        "model_type": "kimi_k25",
        "bos_token_id": special["[BOS]"],
        "eos_token_id": special["[EOS]"],
        "pad_token_id": special["[PAD]"],
        "media_placeholder_token_id": special["<|media_pad|>"],
        "ignore_index": -100,
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "text_config": text,
        "vision_config": vision,
    }
    return config


def _write_kimi_files(path: Path, config: dict) -> None:
    """config.json, preprocessor_config.json and the remote code they name."""
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    preprocessor = {
        "auto_map": {"AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor"},
        "media_proc_cfg": KIMI_MEDIA_PROC_CFG,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    for name in ("configuration_kimi_k25.py", "kimi_k25_vision_processing.py"):
        shutil.copy(KIMI_K25_REMOTE_CODE / name, path / name)


def _save_kimi_weights(path: Path, text: dict, vision: dict, seed: int) -> None:
    """Random language-model weights (fp32, a non-zero routing bias, non-unit final norm) and
    vision weights, in the real checkpoint's names and the hub's layout."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    lm = DeepseekV3ForCausalLM(deepseek_config(DeepseekV3Config, text)).to(torch.float32)
    with torch.no_grad():  # a non-zero routing bias, so the test sees it used
        for layer in lm.model.layers[text["first_k_dense_replace"] :]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    randomize_final_norm(lm)
    save_hub_layout(lm, path, prefix="language_model.", extra=_kimi_vision_weights(vision, text["hidden_size"]))


def deepseek_config(cls, text: dict):
    """The HF DeepSeek-V3 config of a Kimi ``text_config`` (routing fields kept as attributes)."""
    config = cls(**{k: v for k, v in text.items() if k not in ("architectures", "model_type")})
    config.topk_method = text["topk_method"]
    config.scoring_func = text["scoring_func"]
    return config


def _kimi_vision_weights(vision: dict, text_hidden: int) -> dict:
    """Random vision tower and projector weights, named and shaped as in the real checkpoint."""
    import torch

    h, inner, ps = vision["vt_hidden_size"], vision["vt_intermediate_size"], vision["patch_size"]
    merged = h * vision["merge_kernel_size"][0] * vision["merge_kernel_size"][1]

    def rand(*shape, scale=0.02):
        return torch.randn(*shape, dtype=torch.float32) * scale

    def norm(prefix, n):
        return {f"{prefix}.weight": 1.0 + rand(n, scale=0.1), f"{prefix}.bias": rand(n)}

    out = {
        "vision_tower.patch_embed.proj.weight": rand(h, 3, ps, ps),
        "vision_tower.patch_embed.proj.bias": rand(h),
        "vision_tower.patch_embed.pos_emb.weight": rand(
            vision["init_pos_emb_height"], vision["init_pos_emb_width"], h
        ),
        **norm("vision_tower.encoder.final_layernorm", h),
        **norm("mm_projector.pre_norm", h),
        "mm_projector.proj.0.weight": rand(merged, merged),
        "mm_projector.proj.0.bias": rand(merged),
        "mm_projector.proj.2.weight": rand(text_hidden, merged),
        "mm_projector.proj.2.bias": rand(text_hidden),
    }
    for i in range(vision["vt_num_hidden_layers"]):
        block = f"vision_tower.encoder.blocks.{i}"
        out.update(norm(f"{block}.norm0", h))
        out.update(norm(f"{block}.norm1", h))
        out.update({
            f"{block}.wqkv.weight": rand(3 * h, h),
            f"{block}.wqkv.bias": rand(3 * h),
            f"{block}.wo.weight": rand(h, h),
            f"{block}.wo.bias": rand(h),
            f"{block}.mlp.fc0.weight": rand(inner, h),
            f"{block}.mlp.fc0.bias": rand(inner),
            f"{block}.mlp.fc1.weight": rand(h, inner),
            f"{block}.mlp.fc1.bias": rand(h),
        })
    return out


