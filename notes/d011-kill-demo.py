"""Issue #11, "first show it": kill the stock data-generation script at random moments through
``speculators-compat run``, resume with the same command, compare the folder with a clean run.

    python notes/d011-kill-demo.py WORKDIR [--kills 6] [--stock] [--script tests/stock_datagen.py]

``--stock`` runs with ``SPECULATORS_COMPAT_DISABLE=resume,atomic-save`` (the stock save and
resume code alone); without it the runner's folder repair and atomic saves are on. The model
is a random-weight Llama with hidden size 512 and 8 captured layers, so that each sample file
is ~10-25 MB and a kill has a real chance to land inside a save (the test suite's tiny model
writes files in microseconds). Run it from outside the checkout, in the vllm016 environment.
Prints, per kill, where it landed and what the next run found; at the end the verdict per
index: missing, unreadable, or different from the clean run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path


def files(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith("pt")] if folder.exists() else []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir")
    ap.add_argument("--kills", type=int, default=6)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--stock", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--script", default=str(Path(__file__).resolve().parent.parent / "tests" / "stock_datagen.py"))
    args = ap.parse_args()
    import torch

    from speculators_compat import tiny

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not (model / "config.json").exists():
        tiny.build_llama(model, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1024)
    rng = random.Random(args.seed)
    data = work / "train.jsonl"
    if not data.exists():
        with open(data, "w") as fh:
            for _ in range(args.samples):
                n = rng.randint(300, 1500)
                fh.write(json.dumps({"input_ids": [rng.randrange(3, 380) for _ in range(n)],
                                     "loss_mask": [int(rng.random() < 0.5) for _ in range(n)]}) + "\n")
    # SPECULATORS_COMPAT_RECORD (a validation run) passes: until the release is recorded, it is refused without
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_COMPAT_") or k == "SPECULATORS_COMPAT_RECORD"}
    env.update(SPECULATORS_COMPAT_DTYPE="float32", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
    layers = [str(i) for i in range(8)]

    def command(out: Path) -> list[str]:
        return [sys.executable, "-m", "speculators_compat.run", args.script, "--target-model-path", str(model),
                "--train-data-path", str(data), "--output-dir", str(out), "--layer-ids", *layers, "--batch-size", "8"]

    clean = work / "clean"
    if not (clean / "data_config.json").exists():
        subprocess.run(command(clean), env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = work / ("stock" if args.stock else "safe")
    run_env = dict(env, SPECULATORS_COMPAT_DISABLE="resume,atomic-save") if args.stock else env
    for k in range(args.kills + 1):
        log = open(work / f"{out.name}-run{k}.log", "w")
        proc = subprocess.Popen(command(out), env=run_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if k < args.kills:
            target = len(files(out)) + rng.randint(1, 12)
            while proc.poll() is None and len(files(out)) < target:
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.5))
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
        text = (work / f"{out.name}-run{k}.log").read_text(errors="replace")
        found = re.search(r"(output folder \S+: .*)|(Resuming: \d+ files already exist)|(All samples already processed!)", text)
        print(f"run {k}: {'killed' if k < args.kills else 'rc ' + str(proc.returncode)}; {len(files(out))} files; "
              f"start: {found.group(0)[:400] if found else '-'}", flush=True)
    missing, unreadable, different = [], [], []
    worst = 0.0
    for i in range(args.samples):
        path = out / f"data_{i}.pt"
        if not path.exists():
            missing.append(i)
            continue
        try:
            got = torch.load(path, weights_only=True)
        except Exception:  # noqa: BLE001 - any load failure is what we count
            unreadable.append(i)
            continue
        want = torch.load(clean / f"data_{i}.pt", weights_only=True)
        if not torch.equal(got["input_ids"], want["input_ids"]) or not torch.equal(got["loss_mask"], want["loss_mask"]):
            different.append(i)
            continue
        worst = max(worst, max((a - b).abs().max().item() for a, b in zip(got["hidden_states"], want["hidden_states"])))
    print(f"{out.name}: {len(files(out))} files; missing {missing}; unreadable {unreadable}; ids/masks differ {different}; "
          f"max abs diff of the rest {worst:.2g}; data_config.json {'present' if (out / 'data_config.json').exists() else 'MISSING'}")


if __name__ == "__main__":
    main()
