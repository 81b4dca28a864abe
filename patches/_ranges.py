"""The speculators ranges the patches are written for (each patch declares its own vLLM range).

The guards and features are written for vLLM 0.11.1 and later (the two-phase execution); on
0.11.0, what speculators 0.3.0 was written for, nothing of ours wraps the stock code."""

#: speculators releases whose generator/worker the patches were written against
SPECULATORS_03 = ">=0.3.0,<0.4"
#: speculators 0.4.x (vLLM 0.12-0.16), which fixed most API breaks itself
SPECULATORS_04 = ">=0.4.0,<0.5"
#: the library's own guards and options serve every speculators release with the generator
SPECULATORS_ALL = ">=0.3.0,<0.5"
#: vLLM 0.11.1 and later: the two-phase execution (``execute_model``, then ``sample_tokens``)
VLLM_TWO_PHASE = ">=0.11.1"

__all__ = ["SPECULATORS_03", "SPECULATORS_04", "SPECULATORS_ALL", "VLLM_TWO_PHASE"]
