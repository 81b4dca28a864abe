"""A tmpfs of a chosen size for the full-disk tests: root and a private mount namespace (``unshare -m``)."""

from __future__ import annotations

import os
import shutil
import subprocess


def can_mount_tmpfs() -> bool:
    """Whether this machine lets the tests mount a small tmpfs in a private mount namespace."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    proc = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                          capture_output=True, timeout=30)
    return proc.returncode == 0
