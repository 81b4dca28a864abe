"""The stock speculators modules the library patches (shared by the engine and the patches)."""

GENERATOR = "speculators.data_generation.vllm_hidden_states_generator"
WORKER = "speculators.data_generation.custom_worker"

__all__ = ["GENERATOR", "WORKER"]
