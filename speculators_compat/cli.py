"""``speculators-compat`` console script: ``check``, ``demo``, ``run`` and ``verify`` subcommands."""

from __future__ import annotations

import sys

USAGE = (
    "usage: speculators-compat {check [--json] [--deep] | demo [--tp N] "
    "| run [--shard I/N] [--data-parallel K] SCRIPT [ARGS...] | verify OUTPUT_DIR [--full] [--expect N] [--json]}\n"
    "       speculators-compat --version\n"
    "(speculators-compat COMMAND --help: the command's options)"
)

#: the subcommands, as the usage line lists them
COMMANDS = ("check", "demo", "run", "verify")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in {"-V", "--version"}:
        from . import __version__

        print(f"speculators-compat {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "check":
        from .check.command import main as check

        return check(rest)
    if cmd == "run":
        from .run.command import main as run

        return run(rest)
    if cmd == "verify":
        from .run.verify import main as verify

        return verify(rest)
    if cmd == "demo":
        from .demo import main as demo

        return demo(rest)
    print(f"speculators-compat: unknown command: {cmd} (the commands: {', '.join(COMMANDS)})\n{USAGE}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
