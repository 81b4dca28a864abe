"""tf5-config-torch: transformers 5's config dataclass annotates ``torch.dtype`` in a module that
imports torch only for type checkers; the probe finds the one unresolved name and the modules that
need ``torch`` bound."""

from __future__ import annotations

import dataclasses
import sys
import types

from speculators_compat.patches.transformers5 import tf5_config_torch as patch


#: end to end (tests/test_e2e.py, wherever the probe finds the delta): the step that fails when the
#: patch alone is disabled (with the stock-calls check off), and a fragment of the failure
NEEDED_WHERE = {
    # transformers v5 (measured 5.17.0, 5.24.0): `import speculators` 0.3.0 fails without it
    "tf5-config-torch": ("start", "name 'torch' is not defined"),
}


def _config_module(name, annotation):
    module = types.ModuleType(name)
    exec(f"from __future__ import annotations\nimport dataclasses\n\n@dataclasses.dataclass\nclass Config:\n"
         f"    dtype: {annotation} = None\n", module.__dict__)
    return module


def test_the_unresolved_annotation_is_found_and_resolves_with_torch_bound(monkeypatch):
    module = _config_module("fake_configuration_utils", "torch.dtype")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    cls = module.Config
    assert dataclasses.is_dataclass(cls)
    assert patch._unresolved(cls) == "torch"
    fake_torch = types.SimpleNamespace(dtype=type("dtype", (), {}))
    assert patch._unresolved(cls, {"torch": fake_torch}) is None
    assert patch._modules_needing_torch(cls) == [module]
    module.torch = fake_torch  # what the patch binds
    assert patch._modules_needing_torch(cls) == []
    assert patch._unresolved(cls) is None


def test_another_unresolved_name_is_named(monkeypatch):
    module = _config_module("fake_configuration_utils_2", "numpy.dtype")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert patch._unresolved(module.Config) == "numpy"
    assert patch._modules_needing_torch(module.Config) == []
