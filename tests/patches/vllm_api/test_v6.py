"""v6: the probe reads whether the stock Request call passes ``eos_token_id``, Request takes it, and
SamplingParams can carry it; the wrapper moves the EOS id onto the sampling parameters."""

from __future__ import annotations

from probe_inputs import sig
from speculators_compat.patches.vllm_api import v6


#: end to end (tests/test_e2e.py, wherever the probe finds the delta): the step that fails when the
#: patch alone is disabled (with the stock-calls check off), and a fragment of the failure
NEEDED_WHERE = {"v6": ("mixed", "unexpected keyword argument 'eos_token_id'")}


def test_the_judgement():
    update = sig("generation_config", "model_eos_token_id")
    update_eos = sig("generation_config", v6.DROPPED)
    request = sig("request_id", "prompt_token_ids", "sampling_params")
    assert v6._judge({v6.DROPPED}, request, update_eos).shape.value == "new"
    assert v6._judge(set(), request, update_eos).shape.value == "old"  # the stock code does not pass it
    assert v6._judge({v6.DROPPED}, {**request, **sig(v6.DROPPED)}, update_eos).shape.value == "old"
    assert v6._judge({v6.DROPPED}, request, update).shape.value == "unknown"
    assert v6._judge({v6.DROPPED}, request, None).shape.value == "unknown"


class _Sampling:
    def __init__(self):
        self.eos = None

    def update_from_generation_config(self, config, eos):
        self.eos = eos


def test_the_eos_id_goes_to_the_sampling_parameters():
    sampling, seen = _Sampling(), {}
    v6._request(lambda **kw: seen.update(kw), None, (), {"request_id": "r", "sampling_params": sampling,
                                                         v6.DROPPED: 7})
    assert sampling.eos == 7 and v6.DROPPED not in seen and seen["request_id"] == "r"
    v6._request(lambda **kw: None, None, (), {"sampling_params": sampling, v6.DROPPED: None})
    assert sampling.eos == 7  # None: nothing to carry
