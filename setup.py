"""The build. setup.cfg holds everything; this only makes each build start from an empty
``build/lib/speculators_compat``: setuptools copies the sources there and never deletes, so a
module removed from the source would still be shipped in the next wheel built from the same
checkout (``pip install .``, ``python -m build``, tox)."""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py


class CleanBuildPy(build_py):
    """``build_py`` that first empties the package's folder under ``build_lib``."""

    def run(self):
        shutil.rmtree(os.path.join(self.build_lib, "speculators_compat"), ignore_errors=True)
        super().run()


setup(cmdclass={"build_py": CleanBuildPy})
