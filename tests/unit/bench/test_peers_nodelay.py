from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stargate.bench.peers.nodelay import build_shim, preload_env

PROBE = """
import socket
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
cli = socket.create_connection(srv.getsockname())
conn, _ = srv.accept()
print(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0)
"""


def accepted_nodelay(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout.strip()


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_the_shim_sets_nodelay_on_accepted_sockets_only_when_preloaded(tmp_path: Path) -> None:
    assert accepted_nodelay({}) == "False"
    env = preload_env(tmp_path)
    assert accepted_nodelay(env) == "True"
    assert build_shim(tmp_path) == Path(env["LD_PRELOAD"])  # built once, reused
