"""Command-line flags declared once: one default each, optionally replaced by an environment variable.

:class:`FlagSet` is the one environment mechanism of the console scripts. A flag's variable, when
set, becomes the flag's default (the command line still wins) and argparse converts and checks it
with the flag's own ``type``, so a bad value is reported like a bad flag. ``--help`` shows every
default and the variable's name.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Mapping
from typing import Any


def parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {raw!r}")


def non_negative_int(raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {raw!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {raw!r}")
    return value


def positive_int(raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {raw!r}")
    return value


def positive_float(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {raw!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {raw!r}")
    return value


def port(raw: str) -> int:
    value = non_negative_int(raw)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"port out of range: {value}")
    return value


class FlagSet:
    """Adds flags to ``parser``; ``env`` is the process environment (injected, so parsing is pure)."""

    def __init__(self, parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
        self.parser = parser
        self.env = env

    def add(self, flag: str, *aliases: str, env_var: str | None = None, **kw: Any) -> None:
        """The help shows the built-in default, never a variable's value: ``--help`` printed the
        bearer token taken from ``STARGATE_AUTH_TOKEN``."""
        if kw.get("help") != argparse.SUPPRESS:
            notes = [kw.get("help") or "", _describe_default(kw), f"(env {env_var})" if env_var else ""]
            kw["help"] = " ".join(n for n in notes if n) or None
        if env_var is not None and env_var in self.env:
            raw = self.env[env_var]
            kw["default"] = [raw] if kw.get("action") == "append" else raw
            kw.pop("required", None)
            if callable(kw.get("type")):
                kw["type"] = _naming_env(kw["type"], raw, env_var)
        self.parser.add_argument(flag, *aliases, **kw)


def _naming_env(convert: Callable[[str], Any], raw: str, env_var: str) -> Callable[[str], Any]:
    """``convert`` that names ``env_var`` when the value it rejects is the variable's: argparse
    reports a bad default under the flag's name, and the operator never typed that flag."""

    @functools.wraps(convert)
    def checked(value: str) -> Any:
        try:
            return convert(value)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
            if value != raw:
                raise
            reason = str(exc) if isinstance(exc, argparse.ArgumentTypeError) else f"invalid value {value!r}"
            raise argparse.ArgumentTypeError(f"{reason} (from environment variable {env_var})") from None

    return checked


def _describe_default(kw: Mapping[str, Any]) -> str:
    """``(default: …)`` once per flag; nothing for switches, unset values and empty lists."""
    default = kw.get("default")
    if default is None or default == [] or kw.get("action") in ("store_true", "store_false"):
        return ""
    if isinstance(default, bool):
        return f"(default: {'true' if default else 'false'})"
    return f"(default: {default})".replace("%", "%%")  # argparse formats help with %
