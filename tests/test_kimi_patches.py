"""The two patches the Kimi-K2.5 tests brought: their probes on source variants and the
gating of their wrappers, with stand-in classes (no vLLM, torch or transformers here; the
end-to-end tests run them on the real ones: tests/test_e2e.py, test_kimi_k25_*)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from speculators_compat.patches.cpu_platform import cpu_kimi_k25_device
from speculators_compat.patches.features import tokenizer_trust
from speculators_compat.core.registry import Patcher, Shape

# the two calls as speculators 0.3.0 and 0.4.0.1 write them in VllmHiddenStatesGenerator.__init__
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


KIMI_015 = '''def __init__(self, vllm_config, prefix=""):
        self.device = torch.cuda.current_device()
'''


def test_cpu_kimi_k25_device_probe():
    assert cpu_kimi_k25_device._judge(True, KIMI_015).shape is Shape.NEW
    fixed = KIMI_015.replace("torch.cuda.current_device()", "current_platform.current_device()")
    assert cpu_kimi_k25_device._judge(True, fixed).shape is Shape.OLD
    assert cpu_kimi_k25_device._judge(True, "").shape is Shape.OLD  # no Kimi-K2.5 in this vLLM
    assert cpu_kimi_k25_device._judge(False, KIMI_015).shape is Shape.OLD  # a GPU has a CUDA device


def test_cpu_kimi_k25_device_answers_only_inside_the_constructor():
    calls = []

    def current_device():
        calls.append("cuda")
        raise RuntimeError("Found no NVIDIA driver on your system")

    cuda = SimpleNamespace(current_device=current_device)

    class Kimi:
        def __init__(self):
            self.device = cuda.current_device()

    patcher = Patcher()
    patcher.wrap(cuda, "current_device", cpu_kimi_k25_device._current_device)
    patcher.wrap(Kimi, "__init__", cpu_kimi_k25_device._init)
    try:
        assert Kimi().device == "cpu"
        assert calls == []
        try:
            cuda.current_device()
        except RuntimeError as exc:
            assert "NVIDIA" in str(exc)
        else:
            raise AssertionError("outside the constructor the CUDA call must run as it is")
    finally:
        patcher.undo()
