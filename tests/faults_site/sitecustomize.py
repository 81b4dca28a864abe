"""Test tooling: with ``SPECULATORS_COMPAT_TESTING_SELF_CHECK_FAULT`` set, every Python process
started with this folder on ``PYTHONPATH`` (the test's driver, spawned vLLM workers) installs the
self-check's test faults (``selfcheck_faults`` beside this file)."""

import os

if os.environ.get("SPECULATORS_COMPAT_TESTING_SELF_CHECK_FAULT"):
    import selfcheck_faults

    selfcheck_faults.install()
