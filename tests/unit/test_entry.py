"""The console scripts' entry points exit 0 on a signal that comes while they still import."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from stargate import entry


def test_a_signal_while_importing_is_noted_and_one_after_exits_zero() -> None:
    """Noted, not raised, during the import (raising inside a compiled module's initialisation
    crashed the interpreter); after it, the program does not start, and a later signal exits 0."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        entry._guard()
        os.kill(os.getpid(), signal.SIGTERM)  # handled at once, in this thread: no exception
        assert entry._noted == [signal.SIGTERM]
        assert not entry._imported()
        entry._noted.clear()
        entry._guard()
        assert entry._imported()
        for sig in saved:
            with pytest.raises(SystemExit) as exited:
                os.kill(os.getpid(), sig)
            assert exited.value.code == 0
    finally:
        entry._noted.clear()
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_a_server_signalled_while_it_imports_exits_zero() -> None:
    """A real process: guarded, then told to stop in the middle of importing Pylon (over a second)."""
    code = (
        "import sys; from stargate import entry; entry._guard(); print('guarded', flush=True); "
        "import stargate.pylon.cli; sys.exit(0 if not entry._imported() else 3)"
    )
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == "guarded\n"
            child.send_signal(signal.SIGTERM)  # the import takes over half a second from here
            assert child.wait(timeout=30) == 0
        finally:
            child.kill()


@pytest.mark.parametrize(("operators", "expected"), [(None, "ERROR"), ("DEBUG", "DEBUG")])
def test_grpcs_own_log_is_quiet_unless_the_operator_says_otherwise(
    operators: str | None, expected: str
) -> None:
    """gRPC's INFO lines repeated a failed TLS handshake on every retry of a link already reported."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    if operators is not None:
        env["GRPC_VERBOSITY"] = operators
    code = "import os; from stargate import entry; entry._guard(); print(os.environ['GRPC_VERBOSITY'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == expected, out.stderr
