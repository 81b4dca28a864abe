"""Run services: the state that the runner (:mod:`speculators_compat.run`) and the patches share in
one process, apart from the command-line runner itself. Patches reach them through
:mod:`speculators_compat.patching`.

:mod:`.atomic` -- the outputs a run protects and how they are written atomically (:mod:`.holds`:
decisions its deferred files wait for); :mod:`.lifecycle`
-- the generators alive in this process, their workers and Ctrl-C; :mod:`.manifest` -- the run
manifest beside the dataset; :mod:`.leftovers` -- the shared-memory files a run's processes
leave behind. Nothing here imports torch or vLLM, or the runner.
"""
