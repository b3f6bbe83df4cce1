"""A non-editable install of this checkout into a folder, as ``pip install .`` puts it into site-packages: the
sources are copied first, so the build leaves nothing in the checkout."""
import configparser
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("purestep", "core", "models", "optim", "recipes", "bin", "setup.cfg", "pyproject.toml", "README.md")


def install(folder: Path) -> Path:
    """``pip install --no-deps --target`` of a copy of this checkout, built as ``pip install .`` builds it (in an
    isolated environment with pyproject.toml's build backend); the folder that holds ``purestep/``. Through
    ``tests/conftest.py``'s ``installed_site``, once a session."""
    src, site = folder / "src", folder / "site"
    src.mkdir(parents=True)
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                           str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return site


def declared_packages() -> list[str]:
    """setup.cfg's ``packages`` list."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg["options"]["packages"].split()


def collision_project(folder: Path) -> Path:
    """A research project with its own ``models``, ``core`` and ``optim`` packages (the most common folder names in
    ML code): an import of ours that found one of them in purestep's place would fail on the missing names."""
    for name in ("models", "core", "optim"):
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(f"LLAMA = 'the project\\'s own {name}'\n")
    return folder
