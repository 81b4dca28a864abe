"""What the GPU benchmarks share: the environment, the models, the bars, small measurements."""

from __future__ import annotations

import os
import time
from pathlib import Path

for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
               "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)

MODELS = {
    # the shapes of the 2026-12-02 measurements (``docs/gpu.md``)
    "llama-1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                     num_key_value_heads=8, vocab_size=32000),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),
    # a CPU build's model (benchmarks/run.py's shape)
    "llama-cpu": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=2048),
    # a CPU dry run of the script itself
    "llama-tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=4096),
}
#: what the speed rests on: the driver's and the capturing worker's performance patches
#: (offload-captured: CUDA only; driver-threads: only where vLLM lowered the driver's threads)
FEATURES = {"driver": ("results-in-place", "pipelined-steps"), "worker": ("shm-transport", "offload-captured")}
#: the bar extraction / eager prefill has to clear, by model name
TARGETS = {"llama-1b": 0.95, "llama-8b": 0.98}
#: the stock run's bar: this much of what bounds it (the prefill, or the disk where it is slower)
STOCK_TARGET = 0.90


def build(root: Path, names) -> dict:
    from transformers import LlamaConfig

    from speculators_compat.testing import tiny

    out = {}
    for name in names:
        path = root / name
        if (path / "config.json").exists():
            out[name] = "present"
            continue
        t = time.time()
        config = LlamaConfig(max_position_embeddings=32768, bos_token_id=1, eos_token_id=2,
                             tie_word_embeddings=False, torch_dtype="bfloat16", **MODELS[name])
        # final norm as a trained model's: a row normed twice differs (self-check)
        tiny.save_random_llama(path, config, final_norm=True)
        out[name] = f"built in {time.time() - t:.1f} s"
        print(name, out[name], flush=True)
    return out




def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 1) for _ in range(length)] for _ in range(n)]


def _proc_status_gib(key: str, pid: str = "self") -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def rss_gib() -> float:
    return _proc_status_gib("VmRSS:")


def _sched(vllm_config) -> dict | None:
    """What an engine's scheduler was configured with."""
    sched = getattr(vllm_config, "scheduler_config", None)
    if sched is None:
        return None
    return {k: getattr(sched, k, None) for k in ("max_num_batched_tokens", "max_num_seqs", "async_scheduling",
                                                 "enable_chunked_prefill")}



def _runner_v2(vllm_config) -> bool | None:
    """Whether an engine was configured with Model Runner V2 (None: this vLLM cannot say)."""
    try:
        return getattr(vllm_config, "use_v2_model_runner", None)
    except Exception:  # noqa: BLE001 - a property that cannot decide here
        return None


def _fs_type(folder: str) -> str | None:
    """The file system ``folder`` is on (``/proc/mounts``, the longest mount point above it)."""
    best, fs = "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mount = parts[1]
                if (folder == mount or folder.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                    best, fs = mount, parts[2]
    except OSError:
        pass
    return fs
