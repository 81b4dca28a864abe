"""The patch mechanism: the registry of patches, the post-import hooks that apply them, discovery,
the targets and versions they are judged by, the install's verdict (:mod:`.verdict`), the engine's
pre-flight checks, the vLLM plugin entry points, and the library's environment variables
(:mod:`._env`) and logger (:mod:`._log`)."""
