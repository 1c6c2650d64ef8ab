from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from stargate.bench.procs import ManagedProcess, live_process_groups, stop_all
from stargate.errors import ProcessError

# A parent that forks a grandchild into the same process group, prints a ready line and sleeps.
_FAMILY = """
import os, sys, time
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
print("some noise on stderr", file=sys.stderr, flush=True)
print(f"ready child={child}", flush=True)
time.sleep(60)
"""

# Ignores SIGTERM so only the SIGKILL escalation can stop it.
_STUBBORN = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready child=0", flush=True)
time.sleep(60)
"""


def parse(line: str) -> int | None:
    return int(line.split("=", 1)[1]) if line.startswith("ready child=") else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it counts as gone once its state is Z.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.02)
    return False


async def test_stop_kills_the_whole_group_and_keeps_logs(tmp_path: Path) -> None:
    proc = ManagedProcess("family", [sys.executable, "-c", _FAMILY], tmp_path, parse)
    await proc.start()
    grandchild = await proc.wait_ready(10.0)
    assert proc.pid is not None and proc.pid in live_process_groups()
    assert os.getpgid(grandchild) == proc.pid
    await proc.stop(grace_s=5.0)
    assert wait_gone(grandchild)
    assert proc.pid not in live_process_groups()
    assert "ready child=" in proc.stdout_path.read_text()
    assert "some noise on stderr" in proc.stderr_path.read_text()


async def test_sigterm_is_escalated_to_sigkill(tmp_path: Path) -> None:
    proc = ManagedProcess("stubborn", [sys.executable, "-c", _STUBBORN], tmp_path, parse)
    await proc.start()
    await proc.wait_ready(10.0)
    started = time.monotonic()
    await proc.stop(grace_s=0.3)
    assert proc.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 5.0


async def test_early_exit_reports_the_log_tail(tmp_path: Path) -> None:
    script = "import sys; print('bad flag --nope', file=sys.stderr); sys.exit(3)"
    proc = ManagedProcess("broken", [sys.executable, "-c", script], tmp_path, parse)
    await proc.start()
    with pytest.raises(ProcessError) as info:
        await proc.wait_ready(10.0)
    assert "exited with code 3" in str(info.value)
    assert "bad flag --nope" in str(info.value)
    await proc.stop()


async def test_missing_ready_line_times_out(tmp_path: Path) -> None:
    proc = ManagedProcess("silent", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path, parse)
    await proc.start()
    with pytest.raises(ProcessError, match="no ready line"):
        await proc.wait_ready(0.3)
    await proc.stop()
    assert proc.returncode is not None


async def test_group_is_killed_when_the_body_raises(tmp_path: Path) -> None:
    procs = [ManagedProcess(f"p{i}", [sys.executable, "-c", _FAMILY], tmp_path, parse) for i in range(2)]
    grandchildren: list[int] = []
    with pytest.raises(RuntimeError, match="boom"):
        try:
            for proc in procs:
                await proc.start()
                grandchildren.append(await proc.wait_ready(10.0))
            raise RuntimeError("boom")
        finally:
            await stop_all(procs)
    assert all(wait_gone(pid) for pid in grandchildren)
    assert not ({p.pid for p in procs} & live_process_groups())


async def test_unstartable_binary_is_a_process_error(tmp_path: Path) -> None:
    proc = ManagedProcess("nothing", [str(tmp_path / "no-such-binary")], tmp_path, parse)
    with pytest.raises(ProcessError, match="cannot start"):
        await proc.start()


def test_ready_lines_are_parsed_into_addresses() -> None:
    from stargate.bench.fleet import (
        PylonAddrs,
        StargateAddrs,
        parse_engine_ready,
        parse_pylon_ready,
        parse_stargate_ready,
    )

    line = "stargate ready grpc=127.0.0.1:41001 http=127.0.0.1:41002 metrics=127.0.0.1:41003"
    expected = StargateAddrs("127.0.0.1:41001", "127.0.0.1:41002", "127.0.0.1:41003")
    assert parse_stargate_ready(line) == expected
    assert parse_pylon_ready("pylon ready http=127.0.0.1:5000 metrics=5001") == PylonAddrs(
        "127.0.0.1:5000", "127.0.0.1:5001")
    assert parse_engine_ready("INFO stargate-mock-engine listening on http://127.0.0.1:6000/") == (
        "http://127.0.0.1:6000")
    assert parse_stargate_ready("stargate ready http=127.0.0.1:1") is None
    assert parse_pylon_ready("INFO pylon starting") is None
    assert parse_engine_ready("starting") is None


def test_active_servers_reads_the_gauge_for_the_model() -> None:
    from stargate.bench.fleet import active_servers

    text = (
        "# TYPE stargate_active_inference_servers gauge\n"
        'stargate_active_inference_servers{model="m",routing_key=""} 3.0\n'
        'stargate_active_inference_servers{model="other",routing_key=""} 9.0\n'
    )
    assert active_servers(text, "m") == 3
    assert active_servers(text, "missing") == 0
