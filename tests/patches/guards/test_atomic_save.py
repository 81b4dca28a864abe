"""atomic-save: its wrapper of ``Path.write_text`` writes into a protected folder through a temporary
file, and anywhere else through the original call (the folder's protection itself is tested in
tests/run/test_resume.py)."""

from __future__ import annotations

from pathlib import Path

from speculators_compat.services import atomic


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {
    "atomic-save": (
        "tests/test_crash_resume.py (the stock code alone keeps a truncated file; five random kills end "
        "in the clean dataset)"
    ),
}


def test_the_atomic_save_wrapper_of_path_write_text(tmp_path):
    from speculators_compat.patches.guards.atomic_save import _path_write

    out = tmp_path / "out"
    out.mkdir()
    atomic.protect(out)
    try:
        seen = []

        def wrapped(data):  # what wrapt passes: the bound original, here a recorder
            seen.append(data)

        config = out / "data_config.json"
        _path_write(Path.write_text.__get__(config), config, ("{}",), {})
        assert config.read_text() == "{}" and seen == []  # written through a temporary file
        other = tmp_path / "elsewhere.json"
        _path_write(wrapped, other, ("x",), {})
        assert seen == ["x"]  # outside the folder: the original call
    finally:
        atomic.unprotect()
    assert sorted(p.name for p in out.iterdir()) == ["data_config.json"]
