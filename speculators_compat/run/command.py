"""``speculators-compat run SCRIPT [ARGS...]``: run a stock script with the patches active.

Like ``ddtrace-run`` or ``opentelemetry-instrument``: the script runs unchanged as
``__main__`` (its ``if __name__ == "__main__":`` guard works, and so do the worker
processes vLLM spawns, which get the patches through the ``vllm.general_plugins`` entry
point). ``-m MODULE`` runs a module instead of a file.

The runner also puts ``speculators_compat/bootstrap`` first on ``PYTHONPATH``: every process it
starts imports ``speculators_compat`` at start-up (its ``sitecustomize``), so a process that
multiprocessing *spawns* -- which re-imports the script before vLLM loads its plugins -- imports
``speculators`` with the hooks armed too.

Three more things happen around the script:

* speculators' offline data-generation script (``data_generation_offline.py``, recognised
  from its source by :func:`speculators_compat.run.stock_script.recognise`) gets a crash-safe
  ``--output-dir``: when the script has parsed its arguments, the folder is locked against a
  second run, whatever a killed run left that its own ``max(index) + 1`` resume would get
  wrong (a truncated file, a hole below the highest index, a missing ``data_config.json``)
  is moved aside, with one log line, every save into the folder becomes atomic (the
  ``atomic-save`` patch), and the shared memory a killed run left in /dev/shm is removed.
  After a crash, the same command simply runs again and resumes. When the script ends (or
  fails), the run's manifest -- versions, patches, model, layers, self-check totals -- is added
  to ``speculators_compat_manifest.json`` in the folder (:mod:`speculators_compat.services.manifest`).
  ``SPECULATORS_COMPAT_DISABLE=resume`` (or ``all``) leaves the folder alone.
* Ctrl-C (SIGINT) and SIGTERM stop the run cleanly: the script unwinds (the stock script
  finishes its pending saves), the vLLM workers of every live generator are shut down (they
  leave a terminal's Ctrl-C to the runner), one line says so, and the exit code is 130 (SIGINT)
  or 143 (SIGTERM).
* that script can be run as one shard of several (``--shard I/N``, or the ``RANK`` /
  ``SLURM_PROCID`` a launcher gives it, see :mod:`speculators_compat.run.shards`): it extracts its
  block of the dataset into the shared output folder (:mod:`speculators_compat.run.sharded`);
  ``--data-parallel K`` starts K shards on the node's GPU groups (:mod:`speculators_compat.run.parallel`).
"""

from __future__ import annotations

import logging
import os
import runpy
import signal
import sys
import threading

USAGE = (
    "usage: speculators-compat run [--shard I/N] [--data-parallel K] SCRIPT [ARGS...]\n"
    "       speculators-compat run -m MODULE [ARGS...]"
)

HELP = USAGE + """

Run SCRIPT (or -m MODULE) unchanged, as __main__, with speculators_compat's patches armed in this
process and in every Python process it starts (vLLM's workers included). speculators'
data_generation_offline.py (0.3.0 / 0.4.x) also gets a crash-safe --output-dir: run the same
command again after a crash and it resumes.

options (before SCRIPT; everything after SCRIPT goes to the script):
  -h, --help          show this help and exit
  -m MODULE           run a module instead of a file (as python -m MODULE)
  --shard I/N         extract shard I (0-based) of N of the dataset into the shared --output-dir
                      (data_generation_offline.py only); --shard 0/1: the whole dataset
  --data-parallel K   start K shards of the script on this node, each on its own group of the
                      visible GPUs (CUDA_VISIBLE_DEVICES, split evenly; on the CPU: K processes)

environment it reads (a launcher's shard, when --shard is not given):
  RANK, WORLD_SIZE    torchrun and other launchers that follow torch's convention: shard RANK of
                      WORLD_SIZE (LOCAL_RANK, LOCAL_WORLD_SIZE: each process's share of the GPUs)
  SLURM_PROCID, SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), SLURM_STEP_ID
                      an srun job step: shard SLURM_PROCID of the step's tasks
  CUDA_VISIBLE_DEVICES  the GPUs --data-parallel splits (else those nvidia-smi lists)
  SPECULATORS_COMPAT_DISABLE=resume  leave the output folder alone (no resume, no sharding)

exit codes: the script's own; 130 after Ctrl-C, 143 after SIGTERM (pending saves finished);
1 for an output folder it refuses; 2 for a usage error or a path of the stock script's arguments
that does not exist (--target-model-path, --train-data-path, the parent of --output-dir)."""

#: the id that ``SPECULATORS_COMPAT_DISABLE`` takes to leave the output folder alone
RESUME_ID = "resume"


class Terminated(BaseException):
    """Raised in the main thread by the runner's SIGTERM handler (like KeyboardInterrupt)."""


def _log() -> logging.Logger:
    """The runner's logger; its INFO lines show on stderr even if the script configured no
    logging (with a root handler, they reach it by propagation instead)."""
    from ..core import _log as logs

    logs.show("speculators_compat.run", logging.INFO)
    return logging.getLogger("speculators_compat.run")


def _resume_disabled() -> bool:
    from ..core import _env

    return bool(_env.disabled() & {"all", RESUME_ID})


def _stock_script(path: str):
    """The recognised stock data-generation script, ``None`` for any other script; raises
    ``OutputFolderError`` for a script that looks like it but whose save/resume code differs."""
    from . import resume, stock_script

    if _resume_disabled():
        return None
    found = stock_script.recognise(path)
    if found is None:
        return None
    if not found.known:
        raise resume.OutputFolderError(
            f"{path} looks like speculators' data_generation_offline.py, but its save/resume code "
            f"is not the code speculators_compat knows (speculators 0.3.0 / 0.4.x): "
            f"{'; '.join(found.problems)}. Its output folder cannot be made crash-safe: "
            f"SPECULATORS_COMPAT_DISABLE={RESUME_ID} runs it without (a killed run may then leave "
            "truncated or missing samples that its resume does not redo)."
        )
    return found


def _arm_output_folder(found, patcher, shard=None) -> None:
    """Prepare ``--output-dir`` as soon as the script has parsed its arguments (for one shard of
    the dataset with ``shard``, see :mod:`speculators_compat.run.sharded`)."""
    import argparse

    from ..services import manifest
    from . import arguments, resume, sharded

    state = {"done": False}

    def parse_args(wrapped, instance, args, kwargs):
        namespace = wrapped(*args, **kwargs)
        folder = getattr(namespace, "output_dir", None)
        if not state["done"] and isinstance(folder, (str, os.PathLike)):
            state["done"] = True
            _log()  # the runner's lines show even if the script configured no logging
            arguments.check(namespace)  # a typo ends here: no folder made, no preprocessing started
            _output[:] = [os.fspath(folder), shard is not None]
            if shard is not None:
                sharded.arm(namespace, found, shard, patcher)
            else:
                resume.prepare(folder, found)
            manifest.arm(folder, shard.label if shard is not None else None)
        return namespace

    patcher.wrap(argparse.ArgumentParser, "parse_args", parse_args)


#: the output folder the runner armed, and whether it is one shard's ([] before the script parsed its arguments)
_output: list = []

#: executors shut down by their generators' finalizers before the signal (``lifecycle.shutdowns()``)
_before_signal = [0]


def _stop(signame: str, code: int) -> int:
    import sys
    import traceback

    from ..services import lifecycle

    interrupted = sys.exc_info()[2]
    if interrupted is not None:
        # the interrupted call's locals go now: a view of a vLLM shared-memory ring buffer kept
        # in them makes the buffer's close at exit print "BufferError: cannot close exported
        # pointers exist"
        traceback.clear_frames(interrupted)
        del interrupted
    stopped = lifecycle.shutdown_all()
    if not stopped:
        import gc

        gc.collect()  # a generator no one tracked: its __del__ shuts its executor down
    unwound = lifecycle.shutdowns() - _before_signal[0]
    if stopped:
        what = "; ".join(stopped)
    elif unwound:  # the generator went with the script's frames: its own line said so just above
        what = f"{unwound} executor(s) shut down as the script unwound"
    else:
        what = "no live generator to stop"
    _log().warning(
        "interrupted by %s: %s; exit code %d. Run the same command again to resume.", signame, what, code
    )
    return code


def _arm_children() -> None:
    """Every Python process started from here on imports ``speculators_compat`` first (see the
    module docstring and :mod:`speculators_compat.core.children`)."""
    from ..core import children

    children.arm()


def _options(argv: list[str]) -> tuple[dict, list[str]]:
    """The runner's own options, before SCRIPT: ``--shard I/N``, ``--data-parallel K``."""
    options: dict = {}
    while argv and argv[0].partition("=")[0] in ("--shard", "--data-parallel"):
        name, eq, value = argv[0].partition("=")
        if not eq:
            if len(argv) < 2:
                raise ValueError(f"{name} needs a value")
            value, argv = argv[1], argv[2:]
        else:
            argv = argv[1:]
        if name == "--data-parallel":
            if not value.strip().isdigit() or int(value) < 1:
                raise ValueError(f"--data-parallel {value!r}: expected a number of shards >= 1")
            options["data_parallel"] = int(value)
        else:
            options["shard"] = value
    return options, argv


def _shard_for(script: str, found, explicit):
    """The shard this process extracts (``None``: the whole dataset). An explicit ``--shard`` is
    refused for a script that cannot be sharded; a launcher's environment is then ignored."""
    from . import resume, shards, stock_script

    try:
        shard = explicit or shards.from_environment()
    except shards.ShardError as exc:
        raise resume.OutputFolderError(f"the launcher's environment names no shard: {exc}") from None
    if shard is None or shard.count == 1:
        return None
    if found is not None:
        return shard
    if _resume_disabled() and stock_script.recognise(script) is not None:
        why = f"SPECULATORS_COMPAT_DISABLE={RESUME_ID} leaves the output folder, and with it the sharding, alone"
    else:
        why = "only speculators' data_generation_offline.py (0.3.0 / 0.4.x) can be sharded"
    if explicit is None:
        _log().warning("%s: not sharded (%s); the script runs on the whole dataset", shard.describe(), why)
        return None
    raise resume.OutputFolderError(f"{shard.describe()} for {script}: {why}")


def _run(argv: list[str], explicit=None) -> int:
    if argv[0] == "-m":
        if explicit is not None and explicit.count > 1:
            print("speculators-compat run: --shard needs a SCRIPT, not -m MODULE", file=sys.stderr)
            return 2
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
    from ..core.registry import Patcher

    patcher = Patcher()
    found = _stock_script(script)
    shard = _shard_for(script, found, explicit)
    if shard is not None:
        from . import parallel

        narrowed = parallel.narrow_to_local_rank() if shard.launcher == "torch" else None
        if narrowed is not None:
            _log().info("%s: CUDA_VISIBLE_DEVICES=%s (its share of the node's GPUs)", shard.describe(), narrowed)
    if found is not None:
        from . import arguments

        arguments.check_early(argv[1:])  # a typo ends before the script's imports (torch, vLLM: 10 s and more)
        _arm_output_folder(found, patcher, shard)
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        patcher.undo()
    return 0


def _commit_saves(raise_failed: bool = True) -> None:
    """Wait for the samples whose fsync and rename the ``atomic-save`` patch handed to its
    committer (the run's extraction ends when the last is renamed); ``raise_failed``: a save
    into the output folder that failed raises here, so the run does not end as a success."""
    from ..services import atomic

    atomic.flush(raise_failed=raise_failed)


def _write_manifest(manifest, status: str) -> None:
    try:
        manifest.write(status)
    except OSError as exc:  # the dataset stays valid without it: say so, never mask the run's outcome
        _log().warning("could not write the run manifest: %s", exc)


def _data_parallel(workers: int, explicit, argv: list[str]) -> int:
    """``--data-parallel K``: the stock offline script as K shards (:mod:`.parallel`)."""
    from . import parallel, shards, stock_script

    _log()
    found = stock_script.recognise(argv[0]) if argv[0] != "-m" and not _resume_disabled() else None
    if found is None or not found.known:
        print("speculators-compat run: --data-parallel runs speculators' data_generation_offline.py "
              f"(0.3.0 / 0.4.x) as shards; {argv[0]} is not that script", file=sys.stderr)
        return 2
    try:
        return parallel.main(workers, explicit or shards.from_environment(), argv)
    except shards.ShardError as exc:
        print(f"speculators-compat run: {exc}", file=sys.stderr)
        return 2


def _install_signal_handlers(lifecycle):
    """SIGTERM and SIGINT note the shutdowns in flight, then stop the script (where their
    handlers are still Python's defaults). Returns the handlers to put back (None: untouched)."""
    _before_signal[0] = lifecycle.shutdowns()

    def on_sigterm(signum, frame):
        _before_signal[0] = lifecycle.shutdowns()
        raise Terminated()

    def on_sigint(signum, frame):
        _before_signal[0] = lifecycle.shutdowns()
        signal.default_int_handler(signum, frame)

    previous = previous_int = None
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous_int = signal.signal(signal.SIGINT, on_sigint)
    return previous, previous_int


#: the exceptions the runner's handlers raise, and the signal that raises each
_RAISED_BY = ((KeyboardInterrupt, signal.SIGINT), (Terminated, signal.SIGTERM))
#: how long after a dropped handler exception the signal comes again (a finalizer takes microseconds)
REDELIVER_AFTER = 0.05


def _redeliver_swallowed_signals():
    """A handler's exception raised while the main thread runs a finalizer (a weakref callback,
    a ``__del__``: the datapath's pool frees segments in one) is printed and dropped by Python:
    Ctrl-C would print a traceback and the run go on. Instead, the signal comes again to the main
    thread a moment later (from a timer thread: sent from the hook, its handler would run inside
    the hook and be dropped too), when the finalizer has returned. Returns the undo."""
    previous = sys.unraisablehook
    main = threading.main_thread().ident
    armed = [True]

    def again(signum):
        if armed[0]:
            signal.pthread_kill(main, signum)

    def hook(unraisable):
        for raised, signum in _RAISED_BY:
            if armed[0] and unraisable.exc_type is not None and issubclass(unraisable.exc_type, raised):
                timer = threading.Timer(REDELIVER_AFTER, again, (signum,))
                timer.daemon = True  # never holds the interpreter's exit
                try:
                    timer.start()
                except RuntimeError:  # no new thread at interpreter shutdown
                    break
                _log().debug("%s raised in a finalizer: the signal comes again", raised.__name__)
                return
        previous(unraisable)

    def undo():
        armed[0] = False
        sys.unraisablehook = previous

    sys.unraisablehook = hook
    return undo


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print(HELP if argv else USAGE, file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    from . import shards
    from .arguments import ArgumentError
    from .resume import OutputFolderError

    try:
        options, argv = _options(argv)
        explicit = shards.parse(options["shard"]) if "shard" in options else None
    except (ValueError, shards.ShardError) as exc:
        print(f"speculators-compat run: {exc}\n{USAGE}", file=sys.stderr)
        return 2
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    if "data_parallel" in options:
        return _data_parallel(options["data_parallel"], explicit, argv)

    import speculators_compat

    from ..core import _env

    speculators_compat.apply()
    _arm_children()
    os.environ[_env.RUNNER] = str(os.getpid())  # the workers of this process leave Ctrl-C to it

    from ..services import lifecycle
    from . import diskfull

    previous, previous_int = _install_signal_handlers(lifecycle)
    undo_hook = _redeliver_swallowed_signals()
    diskfull.watch()
    _output.clear()
    status = "failed"
    last = None  # the line printed last: a full disk's cause and cure
    try:
        code = _run(argv, explicit)
        _commit_saves()
        status = "finished"
        return code
    except KeyboardInterrupt:
        status = "interrupted by SIGINT"
        return _stop("SIGINT (Ctrl-C)", 130)
    except Terminated:
        status = "interrupted by SIGTERM"
        return _stop("SIGTERM", 143)
    except OutputFolderError as exc:
        print(f"speculators-compat run: {exc}", file=sys.stderr)
        return 1
    except ArgumentError as exc:
        status = f"refused: {exc}"[:2000]
        print(f"speculators-compat run: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:
        status = "finished" if exc.code in (None, 0) else f"exited with code {exc.code}"
        if exc.code in (None, 0):
            try:
                _commit_saves()
            except OSError as error:
                status = f"failed: {type(error).__name__}: {error}"[:2000]
                print(f"speculators-compat run: {error}", file=sys.stderr)
                return 1
        raise
    except Exception as exc:
        status = f"failed: {type(exc).__name__}: {exc}"[:2000]
        try:
            _commit_saves(raise_failed=False)  # the samples it counts are renamed first, not after it
            last = diskfull.diagnose(exc, *(_output or [None, False]))
        except OSError:  # the diagnosis must never mask the run's own error
            last = None
        if last is None:
            raise
        import gc
        import traceback

        traceback.print_exception(exc)  # what failed where; the cause and the cure come last
        traceback.clear_frames(exc.__traceback__)  # the script's frames let its generator go
        del exc
        lifecycle.shutdown_all()  # the workers stop now, their lines before the last one
        gc.collect()
        return 1
    except BaseException as exc:
        status = f"failed: {type(exc).__name__}: {exc}"[:2000]
        raise
    finally:
        from ..services import manifest
        from . import resume

        _commit_saves(raise_failed=False)  # the samples written before an error or an interrupt
        _write_manifest(manifest, status)
        resume.finish()
        diskfull.unwatch()
        if last is not None:
            sys.stderr.flush()
            print(f"speculators-compat run: {last}", file=sys.stderr, flush=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if previous_int is not None:
            signal.signal(signal.SIGINT, previous_int)
        undo_hook()


if __name__ == "__main__":
    sys.exit(main())
