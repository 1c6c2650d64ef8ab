"""Child processes for the bench fleet: started in their own session, logged, always reaped.

Each child runs in a new session (so it leads its own process group) and is stopped by signalling the
whole group: SIGTERM, then SIGKILL after a grace period. Its stdout and stderr are pumped line by line
into log files in the run directory; a caller-supplied parser watches the same lines for the "ready"
line that tells the bound ports. A module-level registry remembers every live group so an ``atexit``
hook (and a SIGTERM raised into the event loop) can still kill them when the normal teardown path did
not run.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Generic, TypeVar

from stargate.errors import ProcessError

T = TypeVar("T")

_LIVE_GROUPS: set[int] = set()
_TAIL_LINES = 40
_MAX_LINE_BYTES = 1 << 20



def _kill_live_groups() -> None:
    for pgid in list(_LIVE_GROUPS):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        _LIVE_GROUPS.discard(pgid)


atexit.register(_kill_live_groups)


def live_process_groups() -> frozenset[int]:
    """Process groups started here and not yet reaped (for tests and diagnostics)."""
    return frozenset(_LIVE_GROUPS)


class ManagedProcess(Generic[T]):
    """One child process whose ready line is parsed into a ``T`` (its bound addresses)."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_dir: Path,
        parse_ready: Callable[[str], T | None],
        *,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.stdout_path = log_dir / f"{name}.stdout.log"
        self.stderr_path = log_dir / f"{name}.stderr.log"
        self._parse_ready = parse_ready
        self._env = env
        self._proc: asyncio.subprocess.Process | None = None
        self._pumps: list[asyncio.Task[None]] = []
        self._ready: asyncio.Future[T] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc is not None else None

    async def start(self) -> None:
        self.stdout_path.parent.mkdir(parents=True, exist_ok=True)
        self._ready = asyncio.get_running_loop().create_future()
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                env=self._env,
                limit=_MAX_LINE_BYTES,
            )
        except OSError as exc:
            raise ProcessError(f"{self.name}: cannot start {self.argv[0]!r}: {exc}") from exc
        _LIVE_GROUPS.add(self._proc.pid)
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self._pumps = [
            asyncio.create_task(self._pump(self._proc.stdout, self.stdout_path.open("w"))),
            asyncio.create_task(self._pump(self._proc.stderr, self.stderr_path.open("w"))),
        ]

    async def _pump(self, stream: asyncio.StreamReader, sink: IO[str]) -> None:
        with sink:
            while True:
                try:
                    raw = await stream.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    raw = await stream.read(_MAX_LINE_BYTES)
                if not raw:
                    return
                line = raw.decode("utf-8", "replace")
                sink.write(line)
                sink.flush()
                if self._ready is not None and not self._ready.done():
                    parsed = self._parse_ready(line.strip())
                    if parsed is not None:
                        self._ready.set_result(parsed)

    async def wait_ready(self, timeout_s: float) -> T:
        """The parsed ready line; raises ProcessError (with log tails) on exit or timeout."""
        if self._proc is None or self._ready is None:
            raise ProcessError(f"{self.name}: not started")
        exited: asyncio.Future[Any] = asyncio.ensure_future(self._proc.wait())
        ready: asyncio.Future[Any] = self._ready
        try:
            done, _ = await asyncio.wait({ready, exited}, timeout=timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not exited.done():
                exited.cancel()
        if self._ready in done:
            return self._ready.result()
        if exited in done:
            await asyncio.gather(*self._pumps, return_exceptions=True)
            raise ProcessError(f"{self.name} exited with code {self._proc.returncode} before it was ready\n"
                               + self.log_tail())
        raise ProcessError(f"{self.name} printed no ready line within {timeout_s:g} s\n" + self.log_tail())

    def log_tail(self, lines: int = _TAIL_LINES) -> str:
        parts = [f"$ {' '.join(self.argv)}"]
        for path in (self.stdout_path, self.stderr_path):
            try:
                text = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            if text:
                parts.append(f"--- {path.name} (last {len(text)} lines)")
                parts.extend(text)
        return "\n".join(parts)

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the whole group (fault injection: SIGKILL, SIGSTOP, SIGCONT); no-op once reaped."""
        if self._proc is not None and self._proc.returncode is None:
            _signal_group(self._proc.pid, sig)

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the whole group, SIGKILL it after ``grace_s``; idempotent."""
        proc = self._proc
        if proc is None:
            return
        try:
            if proc.returncode is None:
                _signal_group(proc.pid, signal.SIGCONT)  # a frozen child could not act on SIGTERM
                _signal_group(proc.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), grace_s)
                except TimeoutError:
                    _signal_group(proc.pid, signal.SIGKILL)
                    await asyncio.wait_for(proc.wait(), grace_s)
            # The leader may be gone while children it forked still run in its group.
            _signal_group(proc.pid, signal.SIGKILL)
        finally:
            _LIVE_GROUPS.discard(proc.pid)
            if self._pumps:
                _, pending = await asyncio.wait(self._pumps, timeout=1.0)
                for pump in pending:
                    pump.cancel()
                await asyncio.gather(*self._pumps, return_exceptions=True)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def stop_all(procs: Sequence[ManagedProcess[Any]], grace_s: float = 5.0) -> None:
    """Stop processes in reverse start order, concurrently; never raises for one child's failure."""
    await asyncio.gather(*(p.stop(grace_s) for p in reversed(procs)), return_exceptions=True)
