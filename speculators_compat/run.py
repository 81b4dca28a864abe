"""``speculators-compat run SCRIPT [ARGS...]``: run a stock script with the patches active.

Like ``ddtrace-run`` or ``opentelemetry-instrument``: the script runs unchanged as
``__main__`` (its ``if __name__ == "__main__":`` guard works, and so do the worker
processes vLLM spawns, which get the patches through the ``vllm.general_plugins`` entry
point). ``-m MODULE`` runs a module instead of a file.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: speculators-compat run SCRIPT [ARGS...] | speculators-compat run -m MODULE [ARGS...]"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    import speculators_compat

    speculators_compat.apply()
    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    script = argv[0]
    if not os.path.isfile(script):
        print(f"speculators-compat run: no such script: {script}", file=sys.stderr)
        return 2
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
