"""Mitigation for routers that accept client connections without ``TCP_NODELAY``.

sglang-router 0.3.2 leaves Nagle's algorithm on for accepted sockets. On a kept-alive connection a
streamed response's small SSE writes then wait for the client's delayed ACK (~40 ms on Linux) once
per request. The mitigation is an ``LD_PRELOAD`` shim, compiled here on first use with the system C
compiler, that sets ``TCP_NODELAY`` on every socket returned by ``accept``/``accept4``; it changes
nothing else. Without a compiler the mitigation is unavailable and says so.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from stargate.errors import ProcessError

SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

static void nodelay(int fd) {
    if (fd >= 0) { int one = 1; setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); }
}

int accept(int fd, struct sockaddr *addr, socklen_t *len) {
    static int (*real)(int, struct sockaddr *, socklen_t *);
    if (!real) real = dlsym(RTLD_NEXT, "accept");
    int conn = real(fd, addr, len);
    nodelay(conn);
    return conn;
}

int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags) {
    static int (*real)(int, struct sockaddr *, socklen_t *, int);
    if (!real) real = dlsym(RTLD_NEXT, "accept4");
    int conn = real(fd, addr, len, flags);
    nodelay(conn);
    return conn;
}
"""

SHIM_NAME = "accept-nodelay.so"


def build_shim(directory: Path) -> Path:
    """Compile the shim into ``directory`` once; returns the shared object's path."""
    target = directory / SHIM_NAME
    if target.is_file():
        return target
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise ProcessError("the TCP_NODELAY mitigation needs a C compiler (cc/gcc) to build its shim")
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "accept-nodelay.c"
    source.write_text(SHIM_SOURCE)
    partial = directory / f".{SHIM_NAME}.partial"
    try:
        done = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(source), "-ldl"],
                              capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ProcessError(f"building the TCP_NODELAY shim failed: {exc}") from exc
    if done.returncode != 0:
        raise ProcessError(f"building the TCP_NODELAY shim failed:\n{done.stderr.strip()}")
    partial.replace(target)
    return target


def preload_env(directory: Path) -> dict[str, str]:
    return {"LD_PRELOAD": str(build_shim(directory))}
