"""The package as pip installs it: one ``purestep`` namespace over the repository's top-level folders (setup.cfg's
``package_dir``), and the ``purestep`` command. The README's research script runs from a non-editable install in a
project with its own ``models``/``core``/``optim``: tests/test_readme.py::test_research_examples_run_verbatim."""
import subprocess
import sys

import installed

REPO = installed.REPO


def test_setup_cfg_lists_every_package_folder():
    """``packages`` is listed by hand (``find:`` cannot prefix the folders with ``purestep.``): a new subpackage
    missing from it would be left out of every wheel."""
    folders = sorted("purestep." + ".".join(p.parent.relative_to(REPO).parts) if p.parts[-2] != "purestep"
                     else "purestep" for top in ("purestep", "core", "models", "optim", "recipes")
                     for p in (REPO / top).rglob("__init__.py") if "__pycache__" not in p.parts)
    assert sorted(installed.declared_packages()) == folders


def test_the_installed_command_and_module_answer(tmp_path, installed_site):
    """The console script and ``python -m purestep`` of a non-editable install, from a folder with a ``models``
    package of its own: both print a recipe's keys."""
    project = installed.collision_project(tmp_path / "project")
    env = {"PYTHONPATH": str(installed_site), "PATH": "/usr/bin:/bin"}
    for command in ([sys.executable, str(installed_site / "bin" / "purestep")], [sys.executable, "-m", "purestep"]):
        proc = subprocess.run([*command, "recipe=standard", "--help"], cwd=project, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0 and proc.stdout.startswith("usage: purestep recipe=standard"), proc.stderr
        assert "model.d_model" in proc.stdout


def test_no_source_names_a_module_outside_the_namespace():
    """A child process the code starts (``python -c`` of a bench's child, ``python -m`` of a plain run) imports from
    ``purestep.``: a top-level ``recipes.``/``core.``/``models.``/``optim.`` name exists only in a checkout (and in a
    research project with its own ``models/``, names another package)."""
    import re
    outside = re.compile(r"""["']from (recipes|core|models|optim)\.|python -m (recipes|core|models|optim)\."""
                         r"""|["']-m["'],\s*["'](recipes|core|models|optim)\.""")
    found = [f"{p.relative_to(REPO)}:{n}" for top in ("core", "models", "optim", "recipes", "bin")
             for p in (REPO / top).rglob("*.py") if "__pycache__" not in p.parts
             for n, line in enumerate(p.read_text().splitlines(), 1) if outside.search(line)]
    assert not found, found
