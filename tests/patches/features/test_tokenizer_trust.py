"""tokenizer-trust: the probe on source variants of the stock constructor, the wrapper's gating with
stand-in classes (no vLLM, torch or transformers here; the end-to-end tests run it on the real ones:
tests/test_e2e.py, test_kimi_k25_*), and its decision on every validated release."""

from __future__ import annotations

import threading
import types
from types import SimpleNamespace

from packaging.version import Version

from probe_inputs import _context_of
from speculators_compat.check import validation
from speculators_compat.core.registry import Patcher, Probe, Shape, Status, evaluate
from speculators_compat.core.targets import GENERATOR
from speculators_compat.patches.features import tokenizer_trust


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {"tokenizer-trust": "tests/test_e2e.py test_kimi_k25_tokenizer_is_remote_code"}


STOCK_INIT = '''def __init__(
        self,
        model_path: str,
        layer_ids: list[int] | None = None,
    ):
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)

        config = AutoConfig.from_pretrained(model_path, trust_remote_code=True)
'''


def test_tokenizer_trust_probe():
    assert tokenizer_trust._judge(STOCK_INIT).shape is Shape.NEW
    fixed = STOCK_INIT.replace("from_pretrained(model_path)", "from_pretrained(model_path, trust_remote_code=True)")
    assert tokenizer_trust._judge(fixed).shape is Shape.OLD
    untrusting = STOCK_INIT.replace(", trust_remote_code=True)", ")")
    assert tokenizer_trust._judge(untrusting).shape is Shape.OLD
    no_tokenizer = STOCK_INIT.replace("AutoTokenizer.from_pretrained(model_path)", "None")
    assert tokenizer_trust._judge(no_tokenizer).shape is Shape.OLD
    assert tokenizer_trust._judge("def __init__(self):\n    pass\n").shape is Shape.UNKNOWN


class AutoTokenizer:
    @classmethod
    def from_pretrained(cls, path, *args, **kwargs):
        return cls, path, kwargs


class Generator:
    def __init__(self, model_path, layer_ids=None):
        self.mine = AutoTokenizer.from_pretrained(model_path)
        self.other = AutoTokenizer.from_pretrained("/elsewhere")
        self.explicit = AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)


def test_tokenizer_trust_only_for_the_generators_own_load():
    patcher = Patcher()
    tokenizer_trust.apply(SimpleNamespace(AutoTokenizer=AutoTokenizer, VllmHiddenStatesGenerator=Generator), patcher)
    try:
        gen = Generator("/models/kimi")
        assert gen.mine == (AutoTokenizer, "/models/kimi", {"trust_remote_code": True})
        assert gen.other == (AutoTokenizer, "/elsewhere", {})
        assert gen.explicit[2] == {"trust_remote_code": False}
        assert Generator(model_path="/models/kimi").mine[2] == {"trust_remote_code": True}
        # outside the constructor (or in another thread while one runs) nothing changes
        assert AutoTokenizer.from_pretrained("/models/kimi") == (AutoTokenizer, "/models/kimi", {})
        seen = []
        thread = threading.Thread(target=lambda: seen.append(AutoTokenizer.from_pretrained("/models/kimi")))
        thread.start()
        thread.join()
        assert seen == [(AutoTokenizer, "/models/kimi", {})]
    finally:
        patcher.undo()
    assert Generator("/models/kimi").mine[2] == {}
    assert "from_pretrained" in vars(AutoTokenizer) and isinstance(vars(AutoTokenizer)["from_pretrained"], classmethod)


def test_tokenizer_trust_applies_on_every_validated_release():
    """Kimi-K2.5 needs tokenizer-trust on every vLLM: no validated release, on any transformers it
    was validated with, may leave it off (it was off on 0.17.0, 0.18.0 and 0.19.1)."""
    import dataclasses

    from speculators_compat.patches.features import tokenizer_trust

    patch = dataclasses.replace(tokenizer_trust.PATCH, probe=lambda m: Probe.new("AutoTokenizer without trust"))
    table = validation.load_table()
    seen = 0
    for spec, part in table["speculators"].items():
        for rel, info in part["vllm"].items():
            for tf in info["transformers"]:
                here = _context_of(rel, spec + ".0", tf, table)
                decision = evaluate(patch, types.ModuleType(GENERATOR), ctx=here)
                want = Status.APPLIES if Version(rel) >= Version("0.11.1") else Status.NOT_NEEDED
                assert decision.status is want, (rel, spec, tf, decision.reason)
                seen += 1
    assert seen >= 40
