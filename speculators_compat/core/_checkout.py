"""Run from a source checkout: find ``speculators_compat.patches`` in the sibling ``patches/``.

Installed, ``patches/`` is the subpackage ``speculators_compat.patches`` (``package_dir`` in
``setup.cfg``). In a source checkout it sits beside ``speculators_compat/``; this finder maps
exactly that one package name to it, so ``python -m speculators_compat.check``, the demo and
the tests work from the checkout root as they do after installing.
"""

from __future__ import annotations

import os
import sys

NAME = "speculators_compat.patches"


class CheckoutPatches:
    """A ``sys.meta_path`` finder for ``speculators_compat.patches`` in a source checkout."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def find_spec(self, fullname, path=None, target=None):  # noqa: ARG002 (finder protocol)
        if fullname != NAME:
            return None
        import importlib.util

        init = os.path.join(self.folder, "__init__.py")
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[self.folder])

    def invalidate_caches(self) -> None:
        pass


def install(package_dir: str) -> None:
    """Arm the finder when ``package_dir`` (this package) has no ``patches`` and its sibling does."""
    if os.path.isdir(os.path.join(package_dir, "patches")):
        return  # installed: the subpackage is where setuptools put it
    sibling = os.path.join(os.path.dirname(package_dir), "patches")
    if os.path.isfile(os.path.join(sibling, "__init__.py")) and not any(
        isinstance(f, CheckoutPatches) for f in sys.meta_path
    ):
        sys.meta_path.append(CheckoutPatches(sibling))
