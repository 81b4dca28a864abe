"""Test tooling: faults injected into the self-check's rows, so that the tests see it catch each one.

Never installed by the library: a test puts this folder (``tests/faults_site``) on ``PYTHONPATH``
with ``SPECULATORS_COMPAT_TESTING_SELF_CHECK_FAULT`` set, and its ``sitecustomize`` calls
:func:`install` in every process of the run (the driver, spawned vLLM workers). That variable
(read here only) names the fault of the next checked calls:

- ``swap``, ``shift``, ``drop``: the driver corrupts the caller's last-layer rows of checked
  sequences (two sequences swapped, rows shifted by one position, a last row replaced);
- ``norm``, ``residual``: the workers capture the last layer as a broken capture point gives it
  (after the final norm; without the residual);
- ``none``: no fault (installed, nothing changed); ``fault@N``: from the process's checked call N on.

The fault of a call travels to the workers on the self-check's plan (an attribute the library
never reads).
"""

from __future__ import annotations

import itertools
import logging
import os

log = logging.getLogger("speculators_compat")

ENV = "SPECULATORS_COMPAT_TESTING_SELF_CHECK_FAULT"
DRIVER_FAULTS = ("swap", "shift", "drop")
WORKER_FAULTS = ("norm", "residual")
#: attribute of a self-check plan naming its fault
FAULT_ATTR = "testing_fault"
#: attribute of a worker's self-check state: the last layer's rows of the step, without the residual
STEP_ATTR = "testing_step"

_calls = itertools.count()
_installed: list = []


def install() -> None:
    """Wrap the self-check's plan, its rows for the workers, and the workers' last-layer hook and
    store (once per process)."""
    if _installed:
        return
    _installed.append(True)
    import wrapt

    from speculators_compat.patches.features.datapath._runtime import checking, compare
    wrapt.wrap_function_wrapper(checking.Plan, "__init__", _plan_init)
    wrapt.wrap_function_wrapper(checking, "rows_for_workers", _rows_for_workers)
    wrapt.wrap_function_wrapper(compare.WorkerCheck, "on_last_layer", _on_last_layer)
    # the store is wrapped outermost once the worker's patches applied (outside mrv2-rows'
    # reordering too: a fault is made in the forward's layout, as a broken capture would)
    wrapt.wrap_function_wrapper(compare, "install_worker", _install_worker)


def current(call: int) -> str:
    """The fault of the process's checked call number ``call``."""
    fault, _, since = os.environ.get(ENV, "").partition("@")
    return "" if since and call < int(since) else fault


def _plan_init(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    setattr(instance, FAULT_ATTR, current(next(_calls)))
    _last_plan[0] = instance


def _fault_of(plan) -> str:
    return getattr(plan, FAULT_ATTR, "") if plan is not None else ""


_last_plan: list = [None]


def _rows_for_workers(wrapped, instance, args, kwargs):
    rows = args[1] if len(args) > 1 else kwargs["rows"]
    fault = _fault_of(_last_plan[0])  # the plan of the call being checked
    if fault in DRIVER_FAULTS:
        corrupted = inject_driver_fault(fault, rows)
        if corrupted:
            log.warning("self-check: test fault %r injected into the checked rows %s", fault, corrupted)
    return wrapped(*args, **kwargs)


def inject_driver_fault(fault: str, rows: list) -> list[int]:
    """Corrupt ``rows`` (the caller's last-layer rows of the checked sequences) as a broken capture
    would; returns the positions in ``rows`` it corrupted."""
    long = [k for k, t in enumerate(rows) if t.shape[0] >= 2]
    if fault == "swap" and len(long) >= 2:
        (ka, kb) = long[:2]
        a, b = rows[ka], rows[kb]
        m = min(a.shape[0], b.shape[0])
        tmp = a[:m].clone()
        a[:m] = b[:m]
        b[:m] = tmp
        return [ka, kb]
    if fault == "shift" and long:
        t = rows[long[0]]
        t[:-1] = t[1:].clone()  # row p holds position p + 1's state
        return [long[0]]
    if fault == "drop" and len(rows) >= 2:
        rows[0][-1] = rows[1][0]  # the last row missing: the next sequence's first row in its place
        return [0]
    return []


def _on_last_layer(wrapped, instance, args, kwargs):
    """The workers' record of the last layer (where the caller does not capture it) as a broken
    capture point gives it; the step's rows without the residual kept for :func:`_store`."""
    module, inputs, output = args
    fault = _fault_of(instance.plan)
    hidden, residual = output if isinstance(output, tuple) and len(output) == 2 else (output, None)
    setattr(instance, STEP_ATTR, hidden if fault == "residual" else None)
    if instance.plan is not None and instance.internal and fault in WORKER_FAULTS:
        rows = hidden + residual if residual is not None else hidden
        output = (instance.norm(rows) if fault == "norm" else hidden.clone(), None)
    return wrapped(module, inputs, output)


def _install_worker(wrapped, instance, args, kwargs):
    """The self-check's hooks are installed once every patch of the worker applied: the store is
    wrapped then (once), outside every patch."""
    result = wrapped(*args, **kwargs)
    if not _stored:
        import sys

        import wrapt

        from speculators_compat.core.targets import WORKER

        _stored.append(True)
        wrapt.wrap_function_wrapper(sys.modules[WORKER].HiddenStatesWorkerExtension, "_store_captured_states", _store)
    return result


_stored: list = []


def _store(wrapped, instance, args, kwargs):
    """The capture's last-layer state of this step as a broken capture point gives it."""
    from speculators_compat.patches.features.datapath._runtime import compare

    state = instance.__dict__.get(compare.WORKER_STATE)
    fault = _fault_of(state.plan) if state is not None else ""
    if state is not None and args and not state.internal and fault in WORKER_FAULTS:
        states = list(args[0])
        step = getattr(state, STEP_ATTR, None)
        if fault == "norm":
            states[-1] = state.norm(states[-1])
        elif step is not None:
            states[-1] = step.clone()
        args = (states,) + tuple(args[1:])
    return wrapped(*args, **kwargs)
