"""Console-script entry points of the servers: a SIGTERM or SIGINT that comes while the program
still imports (over a second on a loaded host) exits 0, as one after start does, not by the signal
(143): nothing is served yet, and a supervisor restarting quickly saw a failure. Each server's own
handlers replace these once its event loop runs."""

from __future__ import annotations

import signal
from types import FrameType


def _exit_cleanly(_signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(0)


def _guard() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)


def stargate() -> int:
    _guard()
    from stargate.cli import main

    return main()


def pylon() -> int:
    _guard()
    from stargate.pylon.cli import main

    return main()


def mock_engine() -> int:
    _guard()
    from stargate.mock_engine.cli import main

    return main()
