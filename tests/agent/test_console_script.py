"""The console scripts in pyproject.toml's [project.scripts] resolve to callables that the package
discovery ships (the Makefile's `pip install --no-deps -e .` turns them into .venv/bin/<name>)."""

import fnmatch
import importlib
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_console_scripts_resolve_to_shipped_callables():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    scripts = project["project"]["scripts"]
    assert "kvfleet-agent" in scripts
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    for name, target in scripts.items():
        module_name, _, attr = target.partition(":")
        assert any(fnmatch.fnmatch(module_name.rsplit(".", 1)[0], pat) for pat in include), (name, include)
        func = getattr(importlib.import_module(module_name), attr)
        assert callable(func), name


def test_makefile_venv_installs_the_project():
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install -q --no-deps -e ." in makefile
    stamp_rule = next(line for line in makefile.splitlines() if line.startswith("$(STAMP):"))
    assert "pyproject.toml" in stamp_rule
