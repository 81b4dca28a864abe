"""A stand-in for speculators 0.4's ``data_generation_offline.py`` with neither torch nor vLLM.

The save and resume code is the stock script's, line for line where it matters (``find_last_checkpoint``,
``save_sample_to_disk``, ``sample_lengths.json`` loaded on a resume and written with ``open()`` at
the end, ``save_config`` after every save, the ``--start-idx`` arithmetic, 4 saving threads), so
``speculators-compat run`` recognises it as the stock script (variant 0.4) and shards it; the
"generator" derives states from the token ids, and ``torch.save`` writes torch's archive format
(``tests/fake_pt.py``). For the runner's unit tests: ``--delay`` sleeps after each batch,
``--die-at I`` ends the process with exit code 3 before generating sample ``I``.
"""

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from datagen_input import read_samples
import fake_pt as torch  # torch.save(obj, path), torch's archive format

MAX_IO_WORKERS = 4


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--target-model-path", default=None)  # the runner checks it; the fake never loads it
    parser.add_argument("--train-data-path", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-samples", type=int, default=None)
    parser.add_argument("--start-idx", type=int, default=0)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--die-at", type=int, default=-1)
    return parser.parse_args()


def find_last_checkpoint(output_dir: str) -> int:
    output_path = Path(output_dir)
    if not output_path.exists():
        return 0
    max_index = -1
    for file_path in output_path.iterdir():
        if file_path.name.startswith("data_") and file_path.name.endswith(".pt"):
            index_str = file_path.stem[5:]
            try:
                index = int(index_str)
                max_index = max(max_index, index)
            except ValueError:
                continue
    return max_index + 1


def save_sample_to_disk(data_dict, output_path):
    torch.save(data_dict, output_path)
    return output_path


class Generator:
    layer_ids = [1, 2, 3]
    hidden = 4

    def generate(self, batch):
        return [{"input_ids": torch.Tensor("int64", (len(ids),), ids),
                 "hidden_states": [torch.Tensor("float32", (len(ids), self.hidden),
                                                [((t + k) % 17) / 8 + layer for t in ids for k in range(self.hidden)])
                                   for layer in self.layer_ids]} for ids in batch]


def save_config(args, generator, num_samples, output_dir):
    config = {"data": {"num_samples": num_samples, "max_samples": args.max_samples},
              "hidden_states": {"layer_ids": generator.layer_ids}, "model": {"hidden_size": generator.hidden}}
    config_path = Path(output_dir) / "data_config.json"
    config_path.write_text(json.dumps(config, indent=2))


def generate_and_save_hidden_states(args, dataset):
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    start_file_idx = find_last_checkpoint(args.output_dir)
    sample_lengths_output_path = Path(args.output_dir) / "sample_lengths.json"
    if start_file_idx > 0 and sample_lengths_output_path.exists():
        with open(sample_lengths_output_path) as f:
            sample_lengths = json.load(f)
    else:
        sample_lengths = {}
    num_samples = len(dataset)
    start_sample_idx = start_file_idx - args.start_idx
    if start_sample_idx >= num_samples:
        print("All samples already processed!", flush=True)
        return 0
    generator = Generator()
    print(f"Processing {num_samples - start_sample_idx}/{num_samples} samples from data_{start_file_idx}.pt", flush=True)
    file_idx = start_file_idx
    with ThreadPoolExecutor(max_workers=MAX_IO_WORKERS) as thread_executor:
        futures = []
        for i in range(start_sample_idx, num_samples, args.batch_size):
            batch_end = min(i + args.batch_size, num_samples)
            batch = dataset[i:batch_end]
            if args.die_at >= 0 and file_idx <= args.die_at < file_idx + len(batch):
                for future in futures:
                    future.result()
                print(f"dying before data_{args.die_at}.pt", flush=True)
                sys.stdout.flush()
                os._exit(3)
            results = generator.generate([s["input_ids"] for s in batch])
            for j, result in enumerate(results):
                input_len = len(result["input_ids"].values)
                sample_lengths[str(file_idx)] = input_len
                mask = batch[j]["loss_mask"][:input_len]
                result_cleaned = {
                    "input_ids": result["input_ids"],
                    "hidden_states": result["hidden_states"],
                    "loss_mask": torch.Tensor("int64", (len(mask),), mask),
                }
                output_path = Path(args.output_dir) / f"data_{file_idx}.pt"
                futures.append(thread_executor.submit(save_sample_to_disk, result_cleaned, output_path))
                file_idx += 1
            if args.delay:
                time.sleep(args.delay)
        for future in as_completed(futures):
            future.result()
    samples_saved = file_idx - start_file_idx
    with open(sample_lengths_output_path, "w") as f:
        json.dump(sample_lengths, f, indent=2)
    save_config(args, generator, num_samples, args.output_dir)
    return samples_saved


def main():
    args = parse_args()
    saved = generate_and_save_hidden_states(args, read_samples(args.train_data_path, args.max_samples))
    print(f"saved {saved} files to {args.output_dir}", flush=True)


if __name__ == "__main__":
    main()
