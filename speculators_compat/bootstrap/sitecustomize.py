"""Start-up hook of the processes started by a process that imported ``speculators_compat``.

``import speculators_compat`` (and ``speculators-compat run``) puts this folder first on
``PYTHONPATH`` (:mod:`speculators_compat.core.children`), so every Python process it starts, and
every process those start, imports ``speculators_compat`` at start-up (which arms the import
hooks; it imports neither torch nor vLLM). That matters for the processes multiprocessing
*spawns* (vLLM's workers): a spawned child re-imports the user's script as ``__mp_main__``
before vLLM loads its plugins, and a script that imports ``speculators`` at its top would do so
unpatched (on transformers v5: ``PydanticUndefinedAnnotation: name 'torch' is not defined``).
``ddtrace-run`` ships the same kind of folder.

A ``sitecustomize`` that this one shadows is found further along ``sys.path`` and run after it.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


try:
    import speculators_compat  # noqa: F401  (arms the hooks)
except ImportError as exc:  # the environment reached an interpreter where it is not installed
    if os.environ.get("SPECULATORS_COMPAT_RUNNER"):  # said under the runner; elsewhere it is not ours
        print(f"speculators-compat: start-up hook not armed ({exc})", file=sys.stderr)
finally:
    _chain()
