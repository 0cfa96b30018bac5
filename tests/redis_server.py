"""A throwaway redis-server for tests: free loopback port, temp dir, no persistence.

Tests use the real server, never a fake, so pipelines, TTLs and a server dying mid-run
behave as they do in production. Without redis-server on PATH the tests skip, saying why.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from types import TracebackType

import pytest
import redis

REDIS_SERVER = shutil.which("redis-server")
SKIP_REASON = "redis-server is not on PATH; install it to run the Redis tier tests"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """Start with ``start()`` (or ``with``), stop with ``stop()``; ``url`` to connect."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.TemporaryDirectory(prefix="kvlife-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> RedisServer:
        if REDIS_SERVER is None:
            pytest.skip(SKIP_REASON)
        self._proc = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self._dir.name,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    if client.ping():
                        return self
                except redis.ConnectionError as exc:
                    if self._proc.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"redis-server did not start on port {self.port}") from exc
                    time.sleep(0.02)
        finally:
            client.close()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def freeze(self) -> None:
        """SIGSTOP the server: connections still open, nothing answers (a hung host)."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Kill the server (abruptly, like a crash) and remove its directory."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self.thaw()  # a frozen process is killed all the same, but let it go cleanly
                self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc = None
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
