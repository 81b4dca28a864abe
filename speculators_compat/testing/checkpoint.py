"""Checkpoints of the tiny models: weights in the hub's layout, written and read back.

The hub's DeepSeek-V3 and Kimi checkpoints store MoE experts one tensor per expert and projection,
which is what vLLM's loader reads; transformers v5 fuses them. These helpers write that layout
whichever transformers is installed, read it back, and check that a model holds exactly what was
saved. torch, transformers and safetensors are imported inside the functions.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["dtype_keyword", "randomize_final_norm", "hub_tensors", "model_layout", "save_hub_layout",
           "saved_tensors", "check_holds"]


def dtype_keyword() -> str:
    """``dtype`` (transformers >= 4.56; v5 deprecates ``torch_dtype``), else ``torch_dtype``."""
    from packaging.version import Version

    from ..core import versions

    found = versions.installed("transformers")
    return "dtype" if found is not None and found.version >= Version("4.56") else "torch_dtype"


def randomize_final_norm(model) -> None:
    """Non-trivial final-norm weights (a trained model's are): a row normed twice, or captured
    after the norm, then differs from the right one (unit weights make the norm idempotent)."""
    import torch

    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)


def hub_tensors(model) -> dict:
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


def model_layout(model, tensors: dict) -> dict:
    """Hub-layout tensors (``hub_tensors``) as ``model.load_state_dict`` wants them: the
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


def save_hub_layout(model, path: Path, prefix: str = "", extra: dict | None = None) -> None:
    """Write ``model.safetensors`` in the hub layout (``hub_tensors``, names under ``prefix``,
    plus ``extra``) and, without a prefix, the model's config.json and generation_config.json --
    not ``save_pretrained``, which on transformers v5 may keep the fused experts."""
    from safetensors.torch import save_file

    tensors = {f"{prefix}{name}": t for name, t in hub_tensors(model).items()}
    tensors.update(extra or {})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    if not prefix:
        model.config.architectures = [type(model).__name__]  # what save_pretrained records
        model.config.save_pretrained(str(path))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(str(path))


def saved_tensors(path: str, prefix: str = "") -> dict:
    """Every tensor of the checkpoint's safetensors files whose name starts with ``prefix``
    (which is cut off)."""
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update({k[len(prefix):]: v for k, v in load_file(os.path.join(path, name)).items()
                        if k.startswith(prefix)})
    return out


def check_holds(model, saved: dict, what: str) -> None:
    """Raise unless ``model`` holds exactly the saved tensors: the same names (in the hub
    layout) and bit-identical values -- no weight missing, left over or re-initialised (the
    routing bias ``e_score_correction_bias`` and every expert included)."""
    import torch

    held = hub_tensors(model)
    missing, unexpected = sorted(set(saved) - set(held)), sorted(set(held) - set(saved))
    if missing or unexpected:
        raise AssertionError(f"{what}: the model lacks saved tensors {missing[:8]} "
                             f"and has tensors not saved {unexpected[:8]}")
    differ = [k for k in sorted(saved) if held[k].shape != saved[k].shape
              or not torch.equal(held[k].to(saved[k].dtype), saved[k])]
    if differ:
        raise AssertionError(f"{what}: {len(differ)} tensors differ from the checkpoint: {differ[:8]}")
