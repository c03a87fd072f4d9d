"""A real ``redis-server`` on a free loopback port, for tests: started, stopped, restarted."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from services.launcher import free_port


class RedisServer:
    """``redis-server`` without persistence (a restart loses everything, like a crash)."""

    def __init__(self, work_dir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        self._binary = binary
        self._pidfile = work_dir / "redis.pid"
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        subprocess.run(
            [
                self._binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                "--appendonly", "no", "--daemonize", "yes", "--pidfile", str(self._pidfile),
            ],
            check=True,
        )  # fmt: skip
        client = redis.Redis.from_url(self.url)
        deadline_s = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline_s:
                    raise
                time.sleep(0.02)
        client.close()

    def stop(self) -> None:
        if not self._pidfile.exists():
            return
        pid = int(self._pidfile.read_text())
        os.kill(pid, signal.SIGKILL)
        deadline_s = time.monotonic() + 10
        while time.monotonic() < deadline_s:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.02)
        self._pidfile.unlink(missing_ok=True)

    def restart(self) -> None:
        self.stop()
        self.start()
