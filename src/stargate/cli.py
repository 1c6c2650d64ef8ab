"""The ``stargate`` console script: the router's flags, plus the ``validate-config`` command.

``stargate [FLAGS]`` runs the router (``stargate.router.cli``); ``stargate validate-config FILE``
checks an `lb-config.json` without starting anything. Exit status 2 means bad usage or a bad file.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from stargate.balancer.config import load_lb_config
from stargate.errors import ConfigError
from stargate.router import cli as router_cli

EXIT_OK = 0
EXIT_USAGE = 2


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    """The router's parser with one subcommand; without a command the flags run the router."""
    parser = router_cli.build_parser(dict(env))
    commands = parser.add_subparsers(
        dest="command", title="commands", metavar="COMMAND",
        description="without one, the flags run the router",
    )
    validate = commands.add_parser(
        "validate-config",
        help="check an lb-config.json file and exit",
        description="Check an lb-config.json file and print the algorithms it configures.",
    )
    validate.add_argument("file", metavar="FILE", help="path of the lb-config.json file to check")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        options = build_parser(os.environ).parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # argparse printed the usage error or the help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if options.command == "validate-config":
        return validate_config(options.file)
    return router_cli.run(options)


def validate_config(file: str) -> int:
    try:
        config = load_lb_config(file)
    except ConfigError as exc:
        print(exc.describe(), file=sys.stderr)
        return EXIT_USAGE
    print(f"{file}: valid")
    print(config.summary())
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
