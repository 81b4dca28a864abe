"""A stand-in for speculators' ``scripts/data_generation_offline.py`` (it never imports speculators_compat).

The real script is not in the speculators wheel (it lives in the speculators repository),
so it is not vendored here. This stand-in reproduces exactly the parts of it that decide
what a killed and resumed run leaves on disk (speculators 0.3.0; 0.4.x only adds
``sample_lengths.json``), with the same function names and the same calls, so that
``speculators-compat run`` recognises it as the stock script:

* ``find_last_checkpoint(output_dir)``: resume at ``max(i) + 1`` over the names that start
  with ``data_`` and end with ``.pt`` and whose stem after ``data_`` is an ``int()``;
* ``save_sample_to_disk``: ``torch.save`` straight to ``data_<i>.pt``, submitted to a
  ``ThreadPoolExecutor`` of 4 threads (out of order), whose futures are only awaited once
  every batch has been generated;
* ``save_config``: ``data_config.json`` written with ``Path.write_text`` after all saves,
  from speculators' own ``DataGenerationConfig.from_generator``;
* "All samples already processed!" (and no config written) when ``max + 1`` reaches the
  dataset size; the generator is built with ``max_model_len`` = the sequence length.

Its ``--tensor-parallel-size`` defaults, as the real script's, to
``torch.accelerator.device_count()`` (0 on a CPU). What differs: samples come pre-tokenized
from a local JSON-lines file (``input_ids``, ``loss_mask``) instead of ``load_and_preprocess_dataset`` (chat template, HF datasets), and
are passed to ``generate`` as the same list of 1-D LongTensors. ``SPECULATORS_DATAGEN_DELAY``
(seconds, tests only) sleeps after each batch, to widen the window in which a test kills the
run; ``SPECULATORS_DATAGEN_REPEAT`` (tests only) makes each batch's ``generate`` call N times
(the same results, calls back to back), so that a test which interrupts "mid-call" finds one
running however fast the machine is. The tests can run the real script instead
(``SPECULATORS_COMPAT_REAL_DATAGEN``, see ``tests/test_crash_resume.py``).
"""

import argparse
import json
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch

try:
    from datasets import config as datasets_config

    DATASETS_CACHE = str(datasets_config.HF_DATASETS_CACHE)
except ImportError:  # only the config's cache_dir needs it (e.g. on the GPU machine, which lacks it)
    DATASETS_CACHE = str(Path.home() / ".cache" / "huggingface" / "datasets")

from speculators.data_generation.config_generator import DataGenerationConfig
from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

# the stand-ins' sample reader sits beside this script (not on sys.path when it is run through runpy)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from datagen_input import read_samples  # noqa: E402

IO_THREADS = 4

logging.basicConfig(level=logging.INFO, format="%(asctime)s - %(name)s - %(levelname)s - %(message)s")
log = logging.getLogger("stock_datagen")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-model-path", required=True)
    ap.add_argument("--train-data-path", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--layer-ids", type=int, nargs="+", default=None)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    # as the real script: 0 on a machine without an accelerator (guard-input takes it as 1 there)
    ap.add_argument("--tensor-parallel-size", type=int, default=torch.accelerator.device_count())
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    ap.add_argument("--max-samples", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-idx", type=int, default=0)
    return ap.parse_args()


def find_last_checkpoint(output_dir):
    """Index of the next file to write: one past the highest data_<i>.pt present."""
    folder = Path(output_dir)
    if not folder.exists():
        return 0
    max_index = -1
    for entry in folder.iterdir():
        name = entry.name
        if not (name.startswith("data_") and name.endswith(".pt")):
            continue
        try:
            max_index = max(max_index, int(entry.stem[5:]))
        except ValueError:
            pass
    return max_index + 1


def save_sample_to_disk(data_dict, output_path):
    torch.save(data_dict, output_path)
    return output_path


def save_config(args, generator, num_samples, output_dir):
    config = DataGenerationConfig.from_generator(
        generator=generator,
        train_data_path=args.train_data_path,
        seq_length=args.max_model_len,
        cache_dir=DATASETS_CACHE,
        num_samples=num_samples,
        max_samples=args.max_samples,
        seed=args.seed,
    )
    config_path = Path(output_dir) / "data_config.json"
    config_path.write_text(json.dumps(config.to_dict(), indent=2))
    log.info(f"Saved config to {config_path}")


def generate_and_save_hidden_states(args, dataset):
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    start_file_idx = find_last_checkpoint(args.output_dir)
    if start_file_idx > 0:
        log.info(f"Resuming: {start_file_idx} files already exist")
    num_samples = len(dataset)
    start_sample_idx = start_file_idx - args.start_idx
    if start_sample_idx >= num_samples:
        log.info("All samples already processed!")
        return 0

    generator = VllmHiddenStatesGenerator(
        model_path=args.target_model_path,
        layer_ids=args.layer_ids,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    delay = float(os.environ.get("SPECULATORS_DATAGEN_DELAY", "0"))
    repeat = int(os.environ.get("SPECULATORS_DATAGEN_REPEAT", "1"))
    file_idx = start_file_idx
    with ThreadPoolExecutor(max_workers=IO_THREADS) as pool:
        pending = []
        for i in range(start_sample_idx, num_samples, args.batch_size):
            batch = dataset[i : min(i + args.batch_size, num_samples)]
            batch_input_ids = [torch.tensor(s["input_ids"], dtype=torch.long) for s in batch]
            batch_loss_mask = [torch.tensor(s["loss_mask"], dtype=torch.long) for s in batch]
            for _ in range(repeat):
                results = generator.generate(batch_input_ids)
            for j, result in enumerate(results):
                input_len = len(result["input_ids"])
                cleaned = {
                    "input_ids": result["input_ids"],
                    "hidden_states": [h.contiguous() for h in result["hidden_states"]],
                    "loss_mask": batch_loss_mask[j][:input_len],
                }
                output_path = Path(args.output_dir) / f"data_{file_idx}.pt"
                pending.append(pool.submit(save_sample_to_disk, cleaned, output_path))
                file_idx += 1
            if delay:
                time.sleep(delay)
        for future in as_completed(pending):
            future.result()
    samples_saved = file_idx - start_file_idx
    save_config(args, generator, num_samples, args.output_dir)
    return samples_saved


def main():
    args = parse_args()
    saved = generate_and_save_hidden_states(args, read_samples(args.train_data_path, args.max_samples))
    print(f"saved {saved} files to {args.output_dir}")


if __name__ == "__main__":
    main()
