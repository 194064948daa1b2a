"""The one build step pyproject.toml cannot say: ship the data folders the package reads at run time.

`speculators/core/package_data.py` lists them (`SHIPPED`: the model shapes, the house target, its workloads and
datasets, vLLM's CPU repairs) by their path in the repository, where they stay top-level folders. A wheel gets a copy
of each under `speculators/_shipped/<same path>` (`package_data.shipped_root()` finds it there); an sdist carries the
folders themselves (MANIFEST.in, the same list). An editable install copies nothing: it reads the clone. Everything
else about the build is in pyproject.toml.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _package_data():
    """speculators/core/package_data.py loaded by path (standard library only; the package is not importable here)."""
    spec = importlib.util.spec_from_file_location("_speculators_package_data",
                                                  ROOT / "speculators" / "core" / "package_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _shipped_files():
    """(repository path, file) of every shipped file, bytecode caches left out."""
    for rel in _package_data().SHIPPED:
        if not (ROOT / rel).is_dir():
            raise FileNotFoundError(f"{rel} is missing from {ROOT}: the wheel would lack data the package reads")
        for path in sorted((ROOT / rel).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                yield path.relative_to(ROOT).as_posix(), path


class BuildWithShippedData(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        into = Path(self.build_lib) / "speculators" / _package_data().INSTALLED_DIR
        shutil.rmtree(into, ignore_errors=True)  # no file left over from an earlier build
        for rel, path in _shipped_files():
            (into / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, into / rel)


setup(cmdclass={"build_py": BuildWithShippedData})
