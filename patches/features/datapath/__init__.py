"""The data path: captured states from the worker to the caller, and the self-check of their rows.

Patches (one module each): ``offload-captured``, ``shm-transport``, ``results-in-place``,
``self-check`` and ``self-check-reference``. Their runtime, by side:

- :mod:`.segments`: shared-memory files, typed views, stale files of killed runs (both sides);
- :mod:`.plan`: a call's layout in the driver's segment (sent to the worker);
- :mod:`.pool`: the driver's segments (allocation, the held-results limit, spare segments);
- :mod:`.worker`: the capturing worker's copies into the segment;
- :mod:`.reply`: the worker's reply and the driver's per-call :class:`~.reply.Transfer`;
- :mod:`.checking` and :mod:`.compare`: the self-check's driver and worker sides.

One captured tensor's walk: ``results_in_place`` (driver) takes a segment from the
:class:`~.pool.Pool`, sends the :class:`~.plan.Plan` to the workers (``worker.accept_plan``) and
gives the stock code a :class:`~.reply.CallExecutor`; in the worker ``shm_transport`` has each
step's rows copied into the segment (:class:`~.worker.WorkerState`) and replies with a
:class:`~.reply.Written`; the driver's :class:`~.reply.Transfer` turns it into the layers the stock
code slices; ``guard-output`` and ``self_check`` read the same call's transfer.
"""
