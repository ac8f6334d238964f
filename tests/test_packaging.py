"""The sdist and the wheel: the package with all its data, and no tests that cannot run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: What the sdist is made of (MANIFEST.in prunes the rest); copied, so the build's
#: egg-info and build/ land in the test's directory, not in the checkout.
SOURCES = ["pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "afkmemory"]


def build(kind: str, source: Path, out: Path) -> Path:
    """Build a ``kind`` ("sdist" or "wheel") of ``source`` with the installed setuptools, offline."""
    out.mkdir(exist_ok=True)
    code = f"import sys; from setuptools import build_meta; print(build_meta.build_{kind}(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", code, str(out)], cwd=source, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


def tracked_package_files() -> list[str]:
    try:
        done = subprocess.run(["git", "ls-files", "afkmemory"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("git is not installed: the package's files are the ones git tracks")
    if done.returncode != 0:
        pytest.skip(f"not a git checkout: {done.stderr.strip()}")
    return done.stdout.split()


@pytest.mark.slow
def test_the_wheel_built_from_the_sdist_has_every_file_of_the_package(tmp_path):
    """A template or py.typed left out of package data breaks only installed copies, never the checkout."""
    if int(version("setuptools").split(".")[0]) < 77:
        pytest.skip(f"setuptools {version('setuptools')} cannot build it (pyproject's SPDX license needs >= 77)")
    tracked = tracked_package_files()
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    sdist = build("sdist", source, tmp_path / "dist")
    with tarfile.open(sdist) as archive:
        names = [name.split("/", 1)[1] for name in archive.getnames() if "/" in name]
        archive.extractall(tmp_path / "unpacked", filter="data")
    # The tests need their conftest.py and settings.py, which setuptools left out: none ship.
    assert not [name for name in names if name.startswith(("tests/", "bench/", "project/"))]
    assert {"LICENSE", "README.md", "pyproject.toml"} <= set(names)

    wheel = build("wheel", tmp_path / "unpacked" / sdist.name.removesuffix(".tar.gz"), tmp_path / "dist")
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
    assert [name for name in tracked if name not in shipped] == []
    assert "afkmemory/templates/admin/afkmemory/typed_filter.html" in tracked  # what the test is for
    assert f"{wheel.name.split('-py3')[0]}.dist-info/licenses/LICENSE" in shipped


#: Imports each module of the package first, in a process of its own forked after django.setup():
#: prints the modules that failed, with their errors.
IMPORT_EACH_FIRST = """
import importlib, os, pkgutil, sys
import django
django.setup()
import afkmemory
failed = []
for module in pkgutil.walk_packages(afkmemory.__path__, "afkmemory."):
    if ".migrations." in module.name or module.name in sys.modules:
        continue
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(module.name)
        except Exception as exc:
            print(module.name, type(exc).__name__, exc)
            os._exit(1)
        os._exit(0)
    os.waitpid(pid, 0)
"""


def test_every_module_imports_first_in_a_new_process():
    """``import afkmemory.api.exceptions`` first (a project's exception handler wrapping ours) was a
    cycle: DRF's views read the parser setting as they load, and our parser imports that module."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", IMPORT_EACH_FIRST], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr[-3000:]
