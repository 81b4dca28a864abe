"""The stock speculators modules the library patches (shared by the engine and the patches)."""

GENERATOR = "speculators.data_generation.vllm_hidden_states_generator"
WORKER = "speculators.data_generation.custom_worker"
#: imported by ``speculators/__init__.py`` before it rebuilds its pydantic schemas and
#: auto-imports ``speculators.models``
SPECULATORS_CONFIG = "speculators.config"
#: imported by ``speculators.config`` before it defines its pydantic config classes
SPECULATORS_UTILS = "speculators.utils"

__all__ = ["GENERATOR", "WORKER", "SPECULATORS_CONFIG", "SPECULATORS_UTILS"]
