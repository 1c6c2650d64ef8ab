"""The ``stargate`` console script.

``stargate validate-config FILE`` checks an `lb-config.json` without starting anything; every other
invocation runs the router (``stargate.router.cli``). Exit status 2 means bad usage or a bad file.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from stargate.balancer.config import load_lb_config
from stargate.errors import ConfigError

EXIT_OK = 0
EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "validate-config":
        return _exit_code(lambda: validate_config(args[1:]))
    return _run_router(args)


def validate_config(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="stargate validate-config",
        description="Check an lb-config.json file and print the algorithms it configures.",
    )
    parser.add_argument("file", metavar="FILE", help="path of the lb-config.json file to check")
    options = parser.parse_args(argv)
    try:
        config = load_lb_config(options.file)
    except ConfigError as exc:
        print(exc.describe(), file=sys.stderr)
        return EXIT_USAGE
    print(f"{options.file}: valid")
    print(config.summary())
    return EXIT_OK


def _run_router(args: list[str]) -> int:
    # Imported lazily: validate-config must work without the router's dependencies being loaded.
    try:
        router_cli = importlib.import_module("stargate.router.cli")
    except ModuleNotFoundError as exc:
        if exc.name not in ("stargate.router", "stargate.router.cli"):
            raise
        print("stargate: the router is not available in this build (stargate.router.cli)", file=sys.stderr)
        return EXIT_USAGE
    run_router: Callable[[list[str]], int] = router_cli.main
    return _exit_code(lambda: run_router(args))


def _exit_code(run: Callable[[], int]) -> int:
    """argparse reports usage errors and ``--help`` by raising SystemExit; keep ``main`` returning."""
    try:
        return run()
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return EXIT_OK
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
