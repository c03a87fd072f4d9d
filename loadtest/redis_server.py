"""A real ``redis-server`` on a free loopback port, for tests and benchmarks: started, stopped,
restarted."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from services.service_process import PortReservation


class RedisServer:
    """``redis-server`` without persistence (a restart loses everything, like a crash). With
    ``password`` it requires AUTH; with ``tls`` it serves TLS only, with a self-signed
    certificate for 127.0.0.1 (``ca_file``) made by the ``openssl`` command. ``host`` is the
    address it binds; ``argv_prefix`` runs it under another command (``ip netns exec NS``: on a
    test host of ``loadtest.netns_hosts``). Its port is held (``PortReservation``) for as long
    as the object lives, so that a restart binds it again."""

    def __init__(
        self,
        work_dir: Path,
        password: str | None = None,
        tls: bool = False,
        host: str = "127.0.0.1",
        argv_prefix: Sequence[str] = (),
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        self._binary = binary
        self._host = host
        self._argv_prefix = list(argv_prefix)
        self._pidfile = work_dir / "redis.pid"
        self._reservation = PortReservation()
        self.port = self._reservation.port
        self.password = password
        self.ca_file: Path | None = None
        self._extra_args: list[str] = []
        if password is not None:
            self._extra_args += ["--requirepass", password]
        if tls:
            self.ca_file, key_file = work_dir / "cert.pem", work_dir / "key.pem"
            subprocess.run(
                [
                    "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key_file), "-out", str(self.ca_file), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1",
                ],
                check=True,
                capture_output=True,
            )  # fmt: skip
            self._extra_args += [
                "--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.ca_file),
                "--tls-key-file", str(key_file), "--tls-auth-clients", "no",
            ]  # fmt: skip
        scheme = "rediss" if tls else "redis"
        self.url = f"{scheme}://{host}:{self.port}/0"

    def start(self) -> None:
        subprocess.run(
            [
                *self._argv_prefix, self._binary, "--bind", self._host, "--port", str(self.port),
                "--save", "",
                "--appendonly", "no", "--daemonize", "yes", "--pidfile", str(self._pidfile),
                *self._extra_args,
            ],
            check=True,
        )  # fmt: skip
        client = redis.Redis.from_url(self.url, **self.client_options())
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

    def client_options(self) -> dict[str, str]:
        """What a client needs besides the URL."""
        options = {"password": self.password} if self.password is not None else {}
        if self.ca_file is not None:
            options["ssl_ca_certs"] = str(self.ca_file)
        return options

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
