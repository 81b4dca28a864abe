"""``python -m speculators_compat.demo``: the stock generator on a tiny local model.

Builds a random-weight Llama and a tokenizer in a temporary folder (no hub), runs the
*stock* ``VllmHiddenStatesGenerator`` with speculators_compat active, and prints the patches
that applied in the driver and in the vLLM workers, the shapes, and the largest difference
from HF transformers in fp32; exits non-zero if it exceeds 1e-4. vLLM's warnings are shown,
except those that carry no information on a CPU (:data:`NOISE`); those and the INFO lines (vLLM's
and the library's) only with ``-v``. The tiny model is kept; its folder is printed.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import re
import subprocess
import sys
import tempfile
import time

from .testing import tiny

#: lines of vLLM, torch, gloo, deepspeed and pydantic that say nothing about the demo (the CPU build
#: on a machine without a GPU); left out of the default output, shown with ``-v``
NOISE = re.compile("|".join([
    r"Setting accelerator to CPU\. If you have GPU",
    r"Enforce eager set, overriding optimization level",
    r"CPU backend prefers block_size",
    r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks",
    r'Field name "torch_dtype" in "\w+" shadows an attribute',
    r"^\s+class MLPSpeculatorConfig\(",
    r"No CUDA runtime is found",
    r"The argument `trust_remote_code` is to be used with Auto classes",
    r"NUMA binding: Using MEMBIND policy",
    r"Loading safetensors checkpoint shards",
    r"^\(\w+ pid=\d+\)\s*$",
    r"\bINFO\b.*\w+\.py:\d+\]?",  # INFO lines (vLLM's, the library's in the workers): -v shows them
]))
#: the demo's own run, in a child process whose output (its workers' included) is filtered
CHILD = "--unfiltered"


def quiet(line: str) -> bool:
    """``line`` is one of the lines that carry no information (:data:`NOISE`)."""
    return bool(NOISE.search(line))


def _filtered(argv: list[str]) -> int:
    """Run the demo in a child process, every line of its output (and its workers') without the noise."""
    proc = subprocess.Popen([sys.executable, "-m", "speculators_compat.demo", CHILD, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        for line in proc.stdout:
            if not quiet(line):
                sys.stdout.write(line)
                sys.stdout.flush()
    except KeyboardInterrupt:
        proc.terminate()
    return proc.wait()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if CHILD in argv:
        argv.remove(CHILD)
    elif not {"-v", "--verbose", "-h", "--help"} & set(argv):
        return _filtered(argv)
    ap = argparse.ArgumentParser(prog="speculators-compat demo", description=__doc__.splitlines()[0].replace("``", ""))
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size (CPU: 1 or 2)")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--model", help="use this model folder instead of building a tiny one")
    ap.add_argument("-v", "--verbose", action="store_true", help="show vLLM's and the library's INFO lines")
    args = ap.parse_args(argv)

    tiny.cpu_environment(args.tp)
    level = logging.INFO if args.verbose else logging.WARNING
    os.environ.setdefault("VLLM_LOGGING_LEVEL", logging.getLevelName(level))  # the workers inherit it
    logging.basicConfig(level=level, format="%(name)s: %(message)s")
    import speculators_compat
    from speculators_compat.core import versions

    clock = [time.time()]

    def step(what: str) -> None:  # each step that can take over ~10 s says what it does first
        now = time.time()
        print(f"speculators-compat demo: {what} ({now - clock[0]:.0f} s so far)", flush=True)

    step("importing torch, transformers and speculators (about 10 s)")
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    if args.model:
        path = args.model
    else:  # kept: the model and its tokenizer are small, and a newcomer's first local model
        step("building a tiny random-weight Llama and its tokenizer (8 layers, hidden 128: 5 MB)")
        path = str(tiny.build_llama(os.path.join(tempfile.mkdtemp(prefix="speculators-compat-demo-"), "tiny-llama")))

    layers = [0, 2, 5, 7]
    step(f"starting the stock generator: vLLM's engine and {args.tp} worker process(es), the model loaded "
         "(10 s to a minute on a CPU)")
    t0 = time.time()
    gen = VllmHiddenStatesGenerator(
        path, layer_ids=layers, max_model_len=1024, tensor_parallel_size=args.tp, dtype="float32"
    )
    started = time.time() - t0
    step(f"generate() on {args.sequences} sequences, then HF transformers on each in fp32 to compare")
    rng = random.Random(0)
    text = "speculative decoding drafts tokens with a small model " * 8
    batch = [gen.tokenizer(text)["input_ids"][: rng.randint(4, 60)]]
    batch += [[rng.randrange(3, 380) for _ in range(rng.randint(1, 400))] for _ in range(args.sequences - 1)]
    t1 = time.time()
    results = gen.generate(batch)
    took = time.time() - t1
    workers = gen.executor.collective_rpc(lambda self: __import__("speculators_compat").applied_ids())
    worst = 0.0
    print(f"\nspeculators_compat demo: {versions.vllm()}, {versions.speculators()}, TP={args.tp}, "
          f"{'the model in ' + path if args.model else 'a tiny random-weight Llama'} in float32")
    print(_patches("driver", "the driver", speculators_compat.applied_ids()))
    print(_patches("worker", f"the {len(workers)} vLLM worker(s)", [p for ids in workers for p in ids]))
    print(f"\ngenerator start {started:.1f} s, generate() {took:.2f} s for {sum(map(len, batch))} tokens")
    for i, (ids, res) in enumerate(zip(batch, results)):
        ref = tiny.hf_reference(path, ids, layers)
        diff = max((a.float() - b).abs().max().item() for a, b in zip(res["hidden_states"], ref))
        worst = max(worst, diff)
        shapes = ", ".join(str(tuple(h.shape)) for h in res["hidden_states"])
        print(f"  sequence {i}: {len(ids):4d} tokens -> layers {layers}: {shapes}; max |vLLM - HF fp32| = {diff:.2e}")
    print(f"max abs diff against HF transformers fp32: {worst:.2e} ({'OK' if worst <= 1e-4 else 'TOO LARGE'})")
    del gen  # its __del__ shuts the executor down and says so
    if not args.model:
        print(f"the tiny model and its tokenizer are kept in {path} "
              f"(speculators-compat demo --model {path} reuses it; delete the folder when done)")
    return 0 if worst <= 1e-4 else 1


def _patches(side: str, where: str, applied: list[str]) -> str:
    """The patches (and passed engine checks) of ``side`` that applied in ``where``, in the order they
    apply, with their titles."""
    from speculators_compat.core import hooks, preflight

    titles = {p.id: p.title for p in [*hooks.patches(), *preflight.CHECKS] if p.side.value == side}
    ids = [pid for pid in titles if pid in set(applied)]
    lines = [f"patches applied in {where} ({len(ids)}):"]
    lines += [f"  {pid:<22} {titles[pid]}" for pid in ids]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
