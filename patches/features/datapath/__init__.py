"""The data path: captured states from the worker to the caller, and the self-check of their rows.

Patches (one module each): ``offload-captured``, ``shm-transport``, ``results-in-place``,
``self-check`` and ``self-check-reference``. Their runtime, by side, is in ``_runtime/`` (helpers, not
patches: discovery does not import them):

- :mod:`._runtime.segments`: shared-memory files, typed views, stale files of killed runs (both sides);
- :mod:`._runtime.plan`: a call's layout in the driver's segment (sent to the worker);
- :mod:`._runtime.pool`: the driver's segments (allocation, the held-results limit, spare segments);
- :mod:`._runtime.worker`: the capturing worker's copies into the segment;
- :mod:`._runtime.reply`: the worker's reply and the driver's per-call :class:`~._runtime.reply.Transfer`;
- :mod:`._runtime.checking` and :mod:`._runtime.compare`: the self-check's driver and worker sides.

One captured tensor's walk: ``results_in_place`` (driver) takes a segment from the
:class:`~._runtime.pool.Pool`, sends the :class:`~._runtime.plan.Plan` to the workers (``worker.accept_plan``) and
gives the stock code a :class:`~._runtime.reply.CallExecutor`; in the worker ``shm_transport`` has each
step's rows copied into the segment (:class:`~._runtime.worker.WorkerState`) and replies with a
:class:`~._runtime.reply.Written`; the driver's :class:`~._runtime.reply.Transfer` turns it into the layers the stock
code slices; ``guard-output`` and ``self_check`` read the same call's transfer.
"""

from ..._ranges import SPECULATORS_03

#: what ``declare`` fills in for the data path's patches, over the features' own (a declaration
#: may name another)
PATCH_DEFAULTS = dict(speculators=SPECULATORS_03)
