"""``pylon`` console script: parse flags, run until SIGTERM/SIGINT.

Exit codes: 0 clean shutdown, 1 startup failure or a critical task ended, 2 usage error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys

from stargate.errors import ConfigError, StargateError
from stargate.pylon.app import PylonApp
from stargate.pylon.config import PylonSettings, parse_settings
from stargate.wire import runner

log = logging.getLogger("stargate.pylon")


async def _main(settings: PylonSettings) -> int:
    app = PylonApp(settings, out=sys.stdout)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    runner.ignore_hangup(loop, log)
    try:
        if not await runner.unless_set(app.start(), stop):
            return 0  # a signal while waiting for the engine (up to --upstream-health-wait-ms)
        return await app.run(stop)
    except ConfigError as exc:  # a listener's address in use: the flag is the operator's to change
        print(f"pylon: error: {exc}", file=sys.stderr)
        return 2
    except StargateError as exc:
        print(f"pylon: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"pylon: cannot start: {exc}", file=sys.stderr)
        return 1
    finally:
        await app.close()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        settings = parse_settings(args, os.environ)
    except ConfigError as exc:
        print(f"pylon: error: {exc}", file=sys.stderr)
        return 2
    runner.configure_logging(settings.log_level)
    return runner.run(_main(settings))


if __name__ == "__main__":
    sys.exit(main())
