"""The package's name, version and metadata, read from the checkout (fast; no build). The built
wheel itself is checked by scripts/wheel_smoke.sh (CI), which installs it away from the checkout."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import tomllib

import braid
from braid import _version

ROOT = pathlib.Path(__file__).resolve().parents[1]
PEP440 = re.compile(r"^\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?$")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_one_version_everywhere():
    v = _version.__version__
    assert PEP440.match(v), v
    assert braid.__version__ == v
    project = _pyproject()["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert _pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "braid._version.__version__"}


def test_version_command():
    proc = subprocess.run([sys.executable, "-m", "braid", "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"braid {braid.__version__} (braid-collectives; "), proc.stdout
    assert "torch " in proc.stdout and "Python " in proc.stdout


def test_changelog_starts_with_this_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    first = next(line for line in text.splitlines() if line.startswith("## "))
    assert first.startswith(f"## {braid.__version__} ("), f"CHANGELOG.md's newest entry is {first!r}, " \
        f"braid is {braid.__version__}: add the version's entry"


def test_distribution_name_and_package_data():
    """Installed as `braid-collectives` (the index's `braid` is another project), imported as
    `braid`; every data file under src/braid is matched by a package-data pattern, so the wheel
    carries it."""
    import fnmatch
    conf = _pyproject()
    assert conf["project"]["name"] == "braid-collectives"
    assert conf["project"]["scripts"] == {"braid": "braid.__main__:main"}
    data = conf["tool"]["setuptools"]["package-data"]
    src = ROOT / "src"
    missing = []
    for f in (src / "braid").rglob("*"):
        if not f.is_file() or f.suffix in (".py", ".pyc") or "__pycache__" in f.parts:
            continue
        pkg = f.parent
        while not (pkg / "__init__.py").exists():
            pkg = pkg.parent
        rel = f.relative_to(pkg).as_posix()
        name = ".".join(pkg.relative_to(src).parts)
        if not any(fnmatch.fnmatch(rel, pat) for pat in data.get(name, [])):
            missing.append(f"{name}: {rel}")
    assert not missing, f"files the wheel would leave out (add them to [tool.setuptools.package-data]): {missing}"
