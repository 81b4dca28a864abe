"""The library's log lines reach the user once: through the application's logging when it has
some, on stderr otherwise (a library's bare ``NullHandler`` would drop its warnings there)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

SCRIPT = """
import logging, sys
if sys.argv[1] == "configured":
    logging.basicConfig(format="ROOT %(name)s %(levelname)s %(message)s")
from speculators_compat.core import _log
_log.logger()
logging.getLogger("speculators_compat.shm").warning("no room in the folder")
logging.getLogger("speculators_compat.shm").info("an info line")
logging.getLogger("speculators_compat.shm").debug("a debug line")
if sys.argv[2] == "runner":
    from speculators_compat.run.command import _log as run_log
    run_log().info("runner info")
    run_log().warning("runner warning")
"""


def _run(*args: str, verbose: bool = False) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_COMPAT_")}
    if verbose:
        env["SPECULATORS_COMPAT_VERBOSE"] = "1"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *args], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]


def test_a_warning_shows_once_on_stderr_when_the_application_configured_no_logging():
    lines = _run("bare", "-")
    assert len(lines) == 1, lines
    assert lines[0].endswith("speculators-compat WARNING: no room in the folder"), lines


def test_a_warning_goes_through_the_applications_logging_once_when_it_has_some():
    assert _run("configured", "-") == ["ROOT speculators_compat.shm WARNING no room in the folder"]


@pytest.mark.parametrize("configured", ["bare", "configured"])
def test_the_runners_info_lines_show_once_either_way(configured):
    lines = _run(configured, "runner")
    assert [ln for ln in lines if "runner" in ln and "INFO" in ln and ln.endswith("runner info")] and \
        sum("runner info" in ln for ln in lines) == 1, lines
    assert sum("runner warning" in ln for ln in lines) == 1, lines
    assert not any("an info line" in ln for ln in lines), lines  # INFO of the library itself: not by default


def test_verbose_shows_everything_once_without_logging_configured():
    lines = _run("bare", "-", verbose=True)
    for text in ("no room in the folder", "an info line", "a debug line"):
        assert sum(text in ln for ln in lines) == 1, (text, lines)


NAMED = """
import logging, sys
from speculators_compat.core import _log
base = logging.getLogRecordFactory()
def factory(*args, **kwargs):  # what vLLM 0.17+ does in its workers (vllm.logger._VllmLogRecordFactory)
    record = base(*args, **kwargs)
    record.vllm_process_name = NAME
    return record
logging.setLogRecordFactory(factory)
if DECORATED:  # a vLLM that prefixes the worker's stderr itself (0.11 - 0.16: vllm.utils' _add_prefix)
    sys.stderr.start_new_line = True
_log.logger()
logging.getLogger("speculators_compat").warning("self-check: off")
"""


@pytest.mark.parametrize("decorated", [False, True])
@pytest.mark.parametrize("name", ["Worker_TP1", "VllmWorker-0", "MainProcess"])
def test_a_vllm_workers_line_starts_with_its_process_name_as_vllms_own_do(name, decorated):
    """vLLM 0.17+ names the worker (``Worker_TP1``) on each record for its own formatter, no longer
    on the worker's stderr: without the name, the ranks' lines could not be told apart."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_COMPAT_")}
    proc = subprocess.run([sys.executable, "-c", f"NAME = {name!r}\nDECORATED = {decorated}\n" + NAMED], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].endswith("speculators-compat WARNING: self-check: off"), lines
    if name == "MainProcess" or decorated:  # not a vLLM worker, or vLLM prefixes the stream itself: none of ours
        assert lines[0][0].isdigit(), lines
    else:
        assert re.match(rf"\({name} pid=\d+\) \d", lines[0]), lines
