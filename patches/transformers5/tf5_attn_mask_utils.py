"""tf5-attn-mask-utils -- ``import speculators`` on transformers >= 5.24 (a removed module).

Delta (transformers 5.24.0; present, deprecated, through 5.23.0): the module
``transformers.modeling_attn_mask_utils`` is gone. speculators 0.3.0's
``speculators/models/eagle.py`` imports ``_prepare_4d_causal_attention_mask`` from it at
the top, and ``speculators/__init__.py`` auto-imports ``speculators.models`` (through
``reload_and_populate_configs()``), so ``import speculators`` fails::

    ModuleNotFoundError: No module named 'transformers.modeling_attn_mask_utils'

The function is used only inside ``EagleSpeculator.forward`` (speculators' EAGLE-1 draft
model), which cannot be reached on transformers v5: building its ``EagleSpeculatorConfig``
already fails there (see ``tf5-config-torch``: speculators' config classes cannot be
instantiated on transformers v5).

How: ``speculators.config.reload_and_populate_configs`` is wrapped (``speculators/__init__``
takes the name after ``speculators.config`` is imported, i.e. after this patch applied):
while it runs, and only if transformers has no such module, ``sys.modules`` holds a
stand-in ``transformers.modeling_attn_mask_utils`` whose only name,
``_prepare_4d_causal_attention_mask``, raises ``CompatError`` when called (naming
transformers and what to pin); once the call returns, the stand-in is removed again, so no
other library ever finds it. Nothing computes with it.

Detection: ``transformers.modeling_attn_mask_utils`` cannot be found
(``importlib.util.find_spec``) while the installed ``speculators/models/eagle.py`` imports
from it: new. The module exists, or speculators no longer imports it: old.

Covers: transformers 5.24.0 with vLLM 0.21.0 and speculators 0.3.0.
Remove when speculators 0.3.x is no longer supported (or requires transformers<5.24).
"""

from __future__ import annotations

import importlib.util
import sys
import types

from speculators_compat.patching import SPECULATORS_CONFIG, CompatError, Probe, declare

from .._probes import transformers_version, wrapping

REMOVED = "transformers.modeling_attn_mask_utils"
FUNCTION = "_prepare_4d_causal_attention_mask"
IMPORTER = "speculators.models.eagle"


def _prepare_4d_causal_attention_mask(*args, **kwargs):  # the stand-in's only name
    raise CompatError(
        f"{REMOVED}.{FUNCTION} was removed in transformers 5.24 (installed: {transformers_version()}); "
        "speculators 0.3.0's EAGLE-1 model needs transformers<5 (speculators_compat only lets "
        "`import speculators` succeed, for hidden-state extraction)"
    )


def stand_in() -> types.ModuleType:
    module = types.ModuleType(
        REMOVED,
        f"speculators_compat stand-in for the module removed in transformers 5.24, present only while "
        f"speculators 0.3.0 imports {IMPORTER}; calling {FUNCTION} raises.",
    )
    setattr(module, FUNCTION, _prepare_4d_causal_attention_mask)
    return module


def _speculators_imports_it(view=None) -> bool:
    from speculators_compat.patching import Sources

    src = view.speculators if view is not None else Sources("speculators")
    return (REMOVED, FUNCTION) in src.imports(IMPORTER, "transformers")


def _module_exists() -> bool:
    try:
        return importlib.util.find_spec(REMOVED) is not None
    except (ImportError, ValueError):
        return False


def _judge(exists: bool, imported: bool) -> Probe:
    version = transformers_version()
    if exists:
        return Probe.old(f"transformers {version} has {REMOVED}")
    if not imported:
        return Probe.old(f"{IMPORTER} does not import {REMOVED}.{FUNCTION}")
    return Probe.new(f"transformers {version} has no {REMOVED}; {IMPORTER} imports {FUNCTION} from it")


def probe(module) -> Probe:
    return _judge(_module_exists(), _speculators_imports_it())


def static_probe(view) -> Probe:
    from speculators_compat.patching import Sources

    # read the installed files: find_spec would import transformers (and torch with it)
    exists = Sources("transformers").module_file(REMOVED) is not None
    return _judge(exists, _speculators_imports_it(view))


def _reload_and_populate(wrapped, instance, args, kwargs):
    if REMOVED in sys.modules or _module_exists():
        return wrapped(*args, **kwargs)
    module = stand_in()
    sys.modules[REMOVED] = module
    try:
        return wrapped(*args, **kwargs)
    finally:
        if sys.modules.get(REMOVED) is module:
            del sys.modules[REMOVED]


apply = wrapping({"reload_and_populate_configs": _reload_and_populate})


PATCH = declare(
    title="import speculators on transformers >= 5.24 (removed mask module)",
    delta="transformers 5.24 removed transformers.modeling_attn_mask_utils, imported by speculators.models.eagle "
    "-> import speculators fails",
    api="transformers.modeling_attn_mask_utils._prepare_4d_causal_attention_mask (in speculators.models.eagle)",
    target=SPECULATORS_CONFIG,  # the driver's side, and every vLLM worker: any process that imports speculators
)
