from __future__ import annotations

import stat
from pathlib import Path

import orjson
import pytest

from stargate.bench.peers.install import (
    MARKER,
    PeerInstallError,
    PeerPackage,
    ensure_installed,
    installed,
    script_path,
    venv_dir,
)

PACKAGE = PeerPackage("toy-router", "1.2.3", "toy-router")

# A stand-in for `python`: `-m venv DIR` makes DIR/bin/python (this same script); `-m pip install X`
# creates the console script beside itself unless X names a version that "does not exist".
FAKE_PYTHON = """#!/bin/sh
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && exit 0; fi
for last; do :; done
case "$last" in *==9.9.9) echo "ERROR: No matching distribution found for $last"; exit 1;; esac
printf '#!%s\\n' "$(dirname "$0")/python" > "$(dirname "$0")/toy-router"
chmod +x "$(dirname "$0")/toy-router"
"""


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    path = tmp_path / "fake-python"
    path.write_text(FAKE_PYTHON)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_package_names() -> None:
    assert PACKAGE.requirement == "toy-router==1.2.3"
    assert PACKAGE.dirname == "toy-router-1.2.3"


def test_ensure_installed_builds_the_venv_then_reuses_it(tmp_path: Path, fake_python: str) -> None:
    root = tmp_path / "peers"
    assert not installed(PACKAGE, root)
    script = ensure_installed(PACKAGE, root, python=fake_python)
    assert script == script_path(PACKAGE, root) == root / "toy-router-1.2.3" / "bin" / "toy-router"
    assert installed(PACKAGE, root)
    assert not (root / "toy-router-1.2.3.partial").exists()
    # the shebang written inside the .partial venv now points at the final location
    assert script.read_text().startswith(f"#!{root / 'toy-router-1.2.3' / 'bin' / 'python'}")
    marker = orjson.loads((venv_dir(PACKAGE, root) / MARKER).read_bytes())
    assert marker["requirement"] == "toy-router==1.2.3"
    assert ensure_installed(PACKAGE, root, python="/nonexistent/python") == script  # no second install


def test_a_venv_without_marker_or_for_another_version_is_not_installed(tmp_path: Path) -> None:
    target = venv_dir(PACKAGE, tmp_path)
    (target / "bin").mkdir(parents=True)
    (target / "bin" / "toy-router").write_text("")
    assert not installed(PACKAGE, tmp_path)
    (target / MARKER).write_bytes(orjson.dumps({"requirement": "toy-router==1.0.0"}))
    assert not installed(PACKAGE, tmp_path)
    (target / MARKER).write_bytes(orjson.dumps({"requirement": "toy-router==1.2.3"}))
    assert installed(PACKAGE, tmp_path)


def test_a_failing_pip_raises_with_the_log_tail(tmp_path: Path, fake_python: str) -> None:
    missing = PeerPackage("toy-router", "9.9.9", "toy-router")
    with pytest.raises(PeerInstallError, match="No matching distribution"):
        ensure_installed(missing, tmp_path, python=fake_python)
    assert not installed(missing, tmp_path)
    assert not venv_dir(missing, tmp_path).exists()


def test_a_missing_interpreter_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(PeerInstallError, match="could not start"):
        ensure_installed(PACKAGE, tmp_path, python=str(tmp_path / "no-python"))
