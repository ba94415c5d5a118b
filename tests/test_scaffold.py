"""`kvbridge new-backend NAME`: a plugin project that kvbridge finds, and whose suite says what is left to write."""

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvbridge.scaffold import _class_name

# A name no installed plugin has, whatever else is installed here.
NAME = f"scaffolded-{uuid.uuid4().hex[:8]}"
PACKAGE = "kvbridge_" + NAME.replace("-", "_")
BACKEND_CLASS = _class_name(NAME) + "Backend"


def kvb(cwd: Path, *args: str, pythonpath: tuple[Path, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, pythonpath), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "kvbridge", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def installed(project: Path, site: Path) -> tuple[Path, ...]:
    """What `pip install -e project` amounts to: its src on the path and a dist-info with its entry points."""
    info = site / f"{PACKAGE}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kvbridge-{NAME}\nVersion: 0.1.0\n")
    pyproject = (project / "pyproject.toml").read_text()
    entry = pyproject.split("[project.entry-points.kvbridge]\n", 1)[1].split("\n", 1)[0]
    (info / "entry_points.txt").write_text(f"[kvbridge]\n{entry.replace(chr(34), '')}\n")  # TOML's quotes go
    return site, project / "src"


def test_new_backend_writes_the_project_the_guide_describes(tmp_path):
    out = kvb(tmp_path, "new-backend", NAME)
    assert out.returncode == 0, out.stderr
    project = tmp_path / f"kvbridge-{NAME}"
    files = sorted(str(p.relative_to(project)) for p in project.rglob("*") if p.is_file())
    assert files == ["README.md", "pyproject.toml", f"src/{PACKAGE}/__init__.py", f"src/{PACKAGE}/backend.py",
                     "tests/test_conformance.py"]
    pyproject = (project / "pyproject.toml").read_text()
    assert '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"' in pyproject
    assert f'[project.entry-points.kvbridge]\n{NAME} = "{PACKAGE}"' in pyproject
    for path in project.rglob("*.py"):
        compile(path.read_text(), str(path), "exec")


def test_the_new_backend_is_listed_and_its_suite_fails_at_the_first_method_to_write(tmp_path):
    assert kvb(tmp_path, "new-backend", NAME, "--directory", "proj").returncode == 0
    path = installed(tmp_path / "proj", tmp_path / "site")
    listed = kvb(tmp_path, "plugins", "--json", pythonpath=path)
    assert listed.returncode == 0, listed.stderr
    assert f'"name": "{NAME}"' in listed.stdout and f'"distribution": "kvbridge-{NAME}"' in listed.stdout
    out = kvb(tmp_path / "proj", "conformance", NAME, "-q", "-k", "registration or lands_byte_exact", pythonpath=path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 passed" in out.stdout  # the registration and the class agree from the start
    assert f"NotImplementedError: {BACKEND_CLASS}.register: register each region's memory with the engine" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["new-backend", "Bad Name"], "argument NAME: 'Bad Name' is not a backend name"),
    (["new-backend", "memory"], "argument NAME: a backend named 'memory' is already installed (from kvbridge)"),
])
def test_a_bad_or_taken_name_is_a_usage_error(tmp_path, args, message):
    out = kvb(tmp_path, *args)
    assert out.returncode == 2 and out.stderr.startswith("usage: kvbridge new-backend") and message in out.stderr
    assert not any(tmp_path.iterdir())


def test_it_never_writes_over_files(tmp_path):
    (tmp_path / f"kvbridge-{NAME}").mkdir()
    (tmp_path / f"kvbridge-{NAME}" / "mine.txt").write_text("keep")
    out = kvb(tmp_path, "new-backend", NAME)
    assert out.returncode == 2 and f"kvbridge-{NAME} already exists and is not an empty directory" in out.stderr
    assert [p.name for p in (tmp_path / f"kvbridge-{NAME}").iterdir()] == ["mine.txt"]
