"""tf5-config-torch -- ``import speculators`` on transformers v5 (the ``torch`` annotation).

Delta (transformers 5.x; seen on 5.5.4, 5.6.0, 5.12.1, 5.17.0 - 5.24.0, absent in 4.57):
``PreTrainedConfig`` became a standard-library dataclass whose ``dtype`` field is annotated
``Union[str, "torch.dtype"] | None``, while ``transformers.configuration_utils`` imports
``torch`` only under ``if TYPE_CHECKING:``. speculators 0.3.0's
``SpeculatorModelConfig(PydanticClassRegistryMixin, PretrainedConfig)`` is a pydantic
model; pydantic takes the dataclass base's fields as its own, and ``speculators/__init__.py``
ends with ``reload_and_populate_configs()``, whose ``model_rebuild(force=True)`` evaluates
that annotation in transformers' module namespace::

    pydantic.errors.PydanticUndefinedAnnotation: name 'torch' is not defined

so ``import speculators`` fails -- in the driver and in every vLLM worker (the worker
extension lives in the speculators package) -- before anything else can run.

How: when ``speculators.config`` has been imported (its classes are defined, their schemas
deferred) and before ``speculators/__init__.py`` rebuilds them, the name ``torch`` is bound
in each module of ``PreTrainedConfig``'s class hierarchy whose annotations name ``torch``
(``transformers.configuration_utils``) to the real ``torch`` module: what the
``TYPE_CHECKING`` import names for type checkers. No transformers or speculators behaviour
changes; ``typing.get_type_hints(PreTrainedConfig)`` is checked to resolve afterwards (if
it does not, applying fails and the binding is undone). The hooks must be armed before
``speculators`` is first imported: ``import speculators_compat`` first, or use
``speculators-compat run``; vLLM workers get them through the ``vllm.general_plugins``
entry point.

Not fixed (it fails loudly, never silently): speculators' own config classes cannot be
instantiated on transformers v5 -- ``PreTrainedConfig.__init_subclass__`` turns every
subclass into a dataclass whose generated ``__init__`` bypasses pydantic's
(``AttributeError: ... no attribute '__pydantic_fields_set__'``). Training, conversion and
loading speculator checkpoints with speculators 0.3.0 need transformers<5; hidden-state
extraction (the generator, the worker extension, the data preprocessing) does not use
these classes.

Detection: ``PreTrainedConfig`` is a dataclass and ``typing.get_type_hints`` fails on it
with ``NameError`` for ``torch`` only (it resolves once ``torch`` is supplied): new. Not a
dataclass, or its annotations resolve: old. Another unresolved name: unknown (refused).
Static (``check``): the class is decorated as a dataclass, an annotation names ``torch.``,
and ``transformers.configuration_utils`` binds no ``torch`` at its top level.

Covers: transformers 5.17.0 and 5.24.0 with vLLM 0.20.0 / 0.21.0 and speculators 0.3.0.
Remove when speculators 0.3.x is no longer supported (or requires transformers<5).
"""

from __future__ import annotations

import ast
import sys

from speculators_compat.patching import SPECULATORS_UTILS, Probe, declare

from .._probes import transformers_version

CONFIG_MODULE = "transformers.configuration_utils"
CLASS_NAMES = ("PreTrainedConfig", "PretrainedConfig")  # v5 name, 4.x name (v5 keeps it as an alias)
NAME = "torch"


def _config_class():
    from transformers import configuration_utils

    for name in CLASS_NAMES:
        cls = getattr(configuration_utils, name, None)
        if cls is not None:
            return cls
    raise LookupError(f"{CONFIG_MODULE} has neither {' nor '.join(CLASS_NAMES)}")


def _unresolved(cls, extra: dict | None = None) -> str | None:
    """The first name ``typing.get_type_hints(cls)`` cannot resolve (``None``: all resolve)."""
    import typing

    try:
        typing.get_type_hints(cls, localns=extra)
    except NameError as exc:
        return exc.name or str(exc)
    return None


def _modules_needing_torch(cls) -> list:
    """The modules of ``cls``'s class hierarchy whose own annotations name ``torch.`` but
    which do not bind ``torch``."""
    out = []
    for klass in cls.__mro__:
        module = sys.modules.get(klass.__module__)
        if module is None or NAME in vars(module) or module in out:
            continue
        annotations = vars(klass).get("__annotations__", {})
        if any(f"{NAME}." in repr(value) for value in annotations.values()):
            out.append(module)
    return out


def probe(module) -> Probe:
    import dataclasses

    version = transformers_version()
    cls = _config_class()
    if not dataclasses.is_dataclass(cls):
        return Probe.old(f"transformers {version}: {cls.__name__} is not a dataclass")
    missing = _unresolved(cls)
    if missing is None:
        return Probe.old(f"transformers {version}: the annotations of {cls.__name__} resolve")
    if missing != NAME:
        return Probe.unknown(
            f"transformers {version}: an annotation of {cls.__name__} names {missing!r}, which "
            f"{CONFIG_MODULE} does not bind (known: only {NAME!r}); pin transformers<5 for speculators 0.3.0"
        )
    import torch

    still = _unresolved(cls, {NAME: torch})
    if still is not None:
        return Probe.unknown(
            f"transformers {version}: {cls.__name__}'s annotations also need {still!r}; pin transformers<5 "
            "for speculators 0.3.0"
        )
    return Probe.new(
        f"transformers {version}: {cls.__name__} is a dataclass annotated with 'torch.dtype', and "
        f"{CONFIG_MODULE} imports torch only for type checkers"
    )


def static_probe(view) -> Probe:
    from speculators_compat.patching import Sources

    version = transformers_version()
    src = Sources("transformers")
    tree = src.tree(CONFIG_MODULE)
    if tree is None:
        raise LookupError(f"cannot read {CONFIG_MODULE} from the installed sources")
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in CLASS_NAMES), None)
    if cls is None:
        raise LookupError(f"{CONFIG_MODULE} defines neither {' nor '.join(CLASS_NAMES)}")
    decorators = [ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in cls.decorator_list]
    if not any(d == "dataclass" or d.endswith(".dataclass") for d in decorators):
        return Probe.old(f"transformers {version}: {cls.name} is not a dataclass")
    names_torch = any(
        isinstance(item, ast.AnnAssign) and f"{NAME}." in ast.unparse(item.annotation) for item in cls.body
    )
    if not names_torch or src.defines(CONFIG_MODULE, NAME):
        return Probe.old(f"transformers {version}: {cls.name}'s annotations resolve at runtime")
    return Probe.new(
        f"transformers {version}: {cls.name} is a dataclass annotated with 'torch.dtype', and "
        f"{CONFIG_MODULE} imports torch only for type checkers"
    )


def apply(module, patcher) -> None:
    import torch

    cls = _config_class()
    for owner in _modules_needing_torch(cls):
        patcher.define(owner, NAME, torch)
    missing = _unresolved(cls)
    if missing is not None:
        raise TypeError(f"{cls.__name__}'s annotations still do not resolve ({missing!r} is undefined)")


PATCH = declare(
    title="import speculators on transformers v5 (torch annotation)",
    delta="transformers v5: PreTrainedConfig is a dataclass annotated 'torch.dtype' (torch imported only "
    "for type checkers) -> pydantic cannot rebuild speculators' configs: import speculators fails",
    api="transformers.configuration_utils.PreTrainedConfig (under speculators.config.SpeculatorModelConfig)",
    target=SPECULATORS_UTILS,  # the driver's side, and every vLLM worker: any process that imports speculators
)
