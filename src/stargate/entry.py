"""Console-script entry points of the servers: a SIGTERM or SIGINT that comes while the program
still imports (over a second on a loaded host) exits 0, as one after start does, not by the signal
(143): nothing is served yet, and a supervisor restarting quickly saw a failure.

The signal is only noted while the program imports (an exception raised inside a compiled
module's initialisation crashed the interpreter), then honoured; after the import a signal ends the
process at once until the server's own handlers replace these as its event loop starts. Python's
own start, before this module runs (tens of milliseconds), stays the signal's. gRPC's own log is
set to errors only here, before gRPC loads, unless the operator set ``GRPC_VERBOSITY``."""

from __future__ import annotations

import os
import signal
from types import FrameType

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_noted: list[int] = []


def _note(signum: int, _frame: FrameType | None) -> None:
    _noted.append(signum)


def _exit_cleanly(_signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(0)


def _guard() -> None:
    for sig in _SIGNALS:
        signal.signal(sig, _note)
    # gRPC's own INFO lines ("Handshake failed ...") repeated on every retry of a link the
    # program's log already reports once; set before gRPC loads, and an operator's value wins.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def _imported() -> bool:
    """Whether the program may start: no signal came while it imported."""
    for sig in _SIGNALS:
        signal.signal(sig, _exit_cleanly)
    return not _noted


def stargate() -> int:
    _guard()
    from stargate.cli import main

    return main() if _imported() else 0


def pylon() -> int:
    _guard()
    from stargate.pylon.cli import main

    return main() if _imported() else 0


def mock_engine() -> int:
    _guard()
    from stargate.mock_engine.cli import main

    return main() if _imported() else 0
