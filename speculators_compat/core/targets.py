"""The stock speculators modules the library patches, and where a refusal stops them.

Shared by the engine and the patches; the engine's policy for refused patches lives here."""

#: the patch set this distribution ships (``patches/``), by name
PATCH_SET = "speculators_compat.patches"
GENERATOR = "speculators.data_generation.vllm_hidden_states_generator"
WORKER = "speculators.data_generation.custom_worker"
#: imported by ``speculators/__init__.py`` before it rebuilds its pydantic schemas and
#: auto-imports ``speculators.models``
SPECULATORS_CONFIG = "speculators.config"
#: imported by ``speculators.config`` before it defines its pydantic config classes
SPECULATORS_UTILS = "speculators.utils"

#: where a refused patch stops its target before any heavy work: (class, method)
ENTRY_POINTS = {
    GENERATOR: ("VllmHiddenStatesGenerator", "__init__"),
    WORKER: ("HiddenStatesWorkerExtension", "_setup_hidden_states_capture"),
}

#: targets imported while ``import speculators`` runs, with no entry point to stop: a refused
#: patch there fails that import with the refusal (instead of the foreign traceback that follows)
REFUSE_AT_IMPORT = frozenset({SPECULATORS_UTILS, SPECULATORS_CONFIG})

#: the attribute of a patch set package (``{target: (patch id, ...)}``) naming the patches that must
#: apply on each target under ``SPECULATORS_COMPAT_UNVALIDATED=self-check`` on a release no
#: validation run covers, or its entry point refuses (the engine names no patch)
UNVALIDATED_REQUIRES = "UNVALIDATED_REQUIRES"

__all__ = ["PATCH_SET", "GENERATOR", "WORKER", "SPECULATORS_CONFIG", "SPECULATORS_UTILS", "ENTRY_POINTS",
           "REFUSE_AT_IMPORT", "UNVALIDATED_REQUIRES"]
