"""api-inventory -- refuse before the weights load when vLLM has drifted beyond the registry.

Problem: each patch probes the one API it repairs. An API that no patch knows about can
change too (a nightly removes a parameter, a module moves); the stock generator then fails
after the executor has started and the model has loaded (up to 20 minutes for a 1T MoE),
or, worse, runs on with a changed meaning.

How: nothing is patched. The probe reads the installed vLLM sources (no import) for every
API the stock generator and worker extension use (their ``from vllm... import`` names and
the executor/scheduler methods they call) and compares each signature with the ones
recorded from the validated releases (``speculators_compat/known_apis.json``). A name that
is gone, a removed parameter or a new required one is an unknown shape: the patch is
refused, and the generator's constructor raises ``IncompatibleVllmError`` naming the API,
the expected and the found signature, before any worker starts. Added optional parameters
(usual in nightlies) pass.

Detection: :mod:`speculators_compat.inventory`; ``python -m speculators_compat.check`` shows
the full inventory.

Remove never: re-record the table (``python -m speculators_compat.inventory
--record``) when a new release is validated.
"""

from __future__ import annotations

from speculators_compat.registry import Kind, Patch, Probe, Side
from speculators_compat.targets import GENERATOR

from .._ranges import SPECULATORS_ALL


def static_probe(view) -> Probe:
    from speculators_compat import inventory

    entries = inventory.inventory(view)
    bad = inventory.unknown(entries)
    if bad:
        return Probe.unknown("unknown API shape: " + "; ".join(bad))
    newer = sum(e["status"] == "compatible" for e in entries)
    text = f"{len(entries)} vLLM APIs of the stock code have recorded shapes"
    return Probe.new(text + (f" ({newer} with added optional parameters only)" if newer else ""))


def probe(module) -> Probe:
    from speculators_compat.sources import StaticView

    return static_probe(StaticView())


def apply(module, patcher) -> None:
    """Nothing to wrap: the probe is the check."""


PATCH = Patch(
    id="api-inventory",
    title="every vLLM API the stock code uses has a known shape",
    delta="any vLLM API of the stock code -> a shape recorded on a validated release",
    api="the vLLM APIs of VllmHiddenStatesGenerator and its worker extension",
    side=Side.DRIVER,
    kind=Kind.GUARD,
    depends_on=(),
    after=("validated-release",),  # the release is judged before its APIs
    target=GENERATOR,
    speculators=SPECULATORS_ALL,
    probe=probe,
    static_probe=static_probe,
    apply=apply,
    upstream="-",
    remove_when="never; re-record known_apis.json for each newly validated vLLM release",
)
