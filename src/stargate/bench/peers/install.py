"""Isolated virtual environments for third-party routers, created on first use.

Each peer lives in ``<root>/<dist>-<version>/`` (root: ``--peers-dir``, env
``STARGATE_BENCH_PEERS_DIR``, else ``~/.cache/stargate-bench/peers``), made with ``python -m venv``
and filled by that venv's own pip from the package index, so nothing a peer pulls in touches this
environment. A venv counts as installed only once ``stargate-bench-peer.json`` (written last) names
the same requirement and the console script exists; a half-built one is built under a ``.partial``
name and renamed at the end, so an interrupted install is retried rather than trusted.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

from stargate.errors import PeerInstallError

MARKER = "stargate-bench-peer.json"
INSTALL_TIMEOUT_S = 900.0



@dataclass(frozen=True)
class PeerPackage:
    """A router distribution pinned to one version and the console script that launches it."""

    dist: str
    version: str
    script: str

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"

    @property
    def dirname(self) -> str:
        return f"{self.dist}-{self.version}"


PEERS_DIR_ENV = "STARGATE_BENCH_PEERS_DIR"
"""The variable of ``--peers-dir`` (``compare``, ``overhead``)."""
DEFAULT_PEERS_ROOT = "~/.cache/stargate-bench/peers"


def peers_root() -> Path:
    """The default root; ``--peers-dir`` (env ``STARGATE_BENCH_PEERS_DIR``) replaces it."""
    return Path(DEFAULT_PEERS_ROOT).expanduser()


def venv_dir(package: PeerPackage, root: Path | None = None) -> Path:
    return (root or peers_root()) / package.dirname


def script_path(package: PeerPackage, root: Path | None = None) -> Path:
    return venv_dir(package, root) / "bin" / package.script


def installed(package: PeerPackage, root: Path | None = None) -> bool:
    """The venv is complete: its marker names this requirement and the console script exists."""
    marker = venv_dir(package, root) / MARKER
    try:
        data = orjson.loads(marker.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return False
    return bool(data.get("requirement") == package.requirement and script_path(package, root).is_file())


def _run(argv: list[str], log: Path, what: str, timeout_s: float) -> None:
    with log.open("ab") as sink:
        sink.write(f"$ {' '.join(argv)}\n".encode())
        sink.flush()
        try:
            done = subprocess.run(argv, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise PeerInstallError(f"{what} did not finish within {timeout_s:g} s (log: {log})") from None
        except OSError as exc:
            raise PeerInstallError(f"{what} could not start: {exc}") from exc
    if done.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise PeerInstallError(f"{what} failed with exit code {done.returncode} (log: {log}):\n"
                               + "\n".join(tail))


def ensure_installed(package: PeerPackage, root: Path | None = None, *,
                     timeout_s: float = INSTALL_TIMEOUT_S, python: str = sys.executable) -> Path:
    """The peer's console script, installing the venv first if it is missing or incomplete."""
    target = venv_dir(package, root)
    if installed(package, root):
        return script_path(package, root)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    log = target.with_name(target.name + ".install.log")
    log.write_bytes(b"")
    started = time.monotonic()
    _run([python, "-m", "venv", str(partial)], log, f"creating the venv for {package.requirement}", timeout_s)
    pip = [str(partial / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "install",
           "--no-input", "--quiet"]
    _run([*pip, package.requirement], log, f"pip install {package.requirement}",
         max(1.0, timeout_s - (time.monotonic() - started)))
    if not (partial / "bin" / package.script).is_file():
        raise PeerInstallError(f"{package.requirement} installed no {package.script!r} console script "
                               f"(log: {log})")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    # venv scripts carry the absolute interpreter path in their shebang: rewrite it after the rename.
    _relocate_shebangs(target / "bin", str(partial), str(target))
    (target / MARKER).write_bytes(orjson.dumps({"requirement": package.requirement,
                                                "installed_at": time.time()}))
    return script_path(package, root)


def _relocate_shebangs(bin_dir: Path, old: str, new: str) -> None:
    old_b, new_b = old.encode(), new.encode()
    for path in bin_dir.iterdir():
        if path.is_symlink() or not path.is_file():
            continue
        with path.open("rb") as fh:
            head = fh.read(2)
        if head != b"#!":
            continue
        data = path.read_bytes()
        if old_b in data:
            path.write_bytes(data.replace(old_b, new_b))
