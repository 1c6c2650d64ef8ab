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
