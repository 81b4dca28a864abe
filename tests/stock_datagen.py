"""A stock-shaped offline data-generation script (it never imports speculators_compat).

Mirrors the shape of speculators' ``scripts/data_generation_offline.py``: build the stock
``VllmHiddenStatesGenerator`` from arguments, read pre-tokenized samples (here a local JSON
lines file of ``input_ids`` and ``loss_mask``), call ``generate`` per batch and save one
``data_<i>.pt`` per sample with ``input_ids``, ``hidden_states`` and the ``loss_mask``
truncated to the returned length. Run it through ``speculators-compat run``.
"""

import argparse
import json
from pathlib import Path

import torch

from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-model-path", required=True)
    ap.add_argument("--train-data-path", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--layer-ids", type=int, nargs="+", default=None)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    args = ap.parse_args()

    samples = [json.loads(line) for line in Path(args.train_data_path).read_text().splitlines() if line]
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    generator = VllmHiddenStatesGenerator(
        model_path=args.target_model_path,
        layer_ids=args.layer_ids,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    file_idx = 0
    for start in range(0, len(samples), args.batch_size):
        batch = samples[start : start + args.batch_size]
        results = generator.generate([s["input_ids"] for s in batch])
        for sample, result in zip(batch, results):
            n = len(result["input_ids"])
            torch.save(
                {
                    "input_ids": result["input_ids"],
                    "hidden_states": [h.contiguous() for h in result["hidden_states"]],
                    "loss_mask": torch.tensor(sample["loss_mask"][:n]),
                },
                out / f"data_{file_idx}.pt",
            )
            file_idx += 1
    print(f"saved {file_idx} files to {out}")


if __name__ == "__main__":
    main()
