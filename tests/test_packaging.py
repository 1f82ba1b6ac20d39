"""Every package of the source tree is one the distribution installs: pyproject.toml lists its
packages one by one (the folders map onto torchautopsy.*), and a folder left out installs
nothing, which an editable install (the tests') never notices but `pip install .` does."""

from __future__ import annotations

import os
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_package_folder_is_installed():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    dirs = setuptools["package-dir"]
    assert sorted(setuptools["packages"]) == sorted(dirs)
    folders = set()
    for top in ("toplevel", "recorder", "analyzer", "reports"):
        for here, _, files in os.walk(os.path.join(ROOT, top)):
            if "__init__.py" in files and "__pycache__" not in here:
                folders.add(os.path.relpath(here, ROOT).replace(os.sep, "/"))
    assert folders == set(dirs.values()), folders ^ set(dirs.values())
