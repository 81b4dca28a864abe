"""The patch set: one module per vLLM API delta, stock-code fix, platform fix, guard or feature.

Every module of the groups below that defines ``PATCH`` (a :class:`~speculators_compat.patching.Patch`)
is registered (:mod:`speculators_compat.core.discovery`); its file name is its id, with ``_`` for
``-``, and its docstring gives the delta, how it is detected, and when it can be removed. What the
patches of a group share (their kind, ranges, target) is the group's ``PATCH_DEFAULTS``, which
``declare`` fills in where a declaration does not name it. Within
one target module, a patch applies after the patches its ``after=`` names, and so wraps them (the
guards wrap the repaired generator): ``after=`` is declared where a patch wraps a name another
patch touched, or uses its module; patches that ``after=`` does not order apply in the order of
their groups here, then of their ids. The engine's checks (:mod:`speculators_compat.check.checks`,
run by :mod:`speculators_compat.core.preflight`) run after every patch of their target and read
the ``calls=`` of those that apply.
A patch imports another patch's module only when it applies after it.

The private modules hold what several patches use: ``_probes`` (helpers for probes), ``_ranges``
(the version ranges) and ``_idle_output`` (the scheduler output that ``v5``, ``s04-scheduler-loop``
and ``guard-input`` share). Importing this package imports neither torch nor vLLM.
"""

from speculators_compat.patching import GENERATOR, WORKER

#: what ``SPECULATORS_COMPAT_UNVALIDATED=self-check`` needs applied on each target (the driver's
#: check and the workers' reference), or the target's entry point refuses
UNVALIDATED_REQUIRES = {GENERATOR: ("self-check",), WORKER: ("self-check-reference",)}

#: the groups, in the order ties are broken (see above)
GROUPS = (
    "transformers5",  # what `import speculators` 0.3.0 needs on transformers v5
    "vllm_api",  # vLLM changes the stock 0.3.x generator and worker trip on (v1 .. v7 and defaults)
    "speculators04",  # bugs of speculators 0.4.x's own generator loop
    "cpu_platform",  # vLLM's CPU platform: device memory without a GPU, CPU kernels
    "features",  # options and improvements the stock code does not have
    "guards",  # input and output checks, a dead worker named, atomic writes
)
