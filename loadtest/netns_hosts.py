"""Several test hosts on one machine: network namespaces joined by a private bridge.

``HostNetwork(["head", "prefill", "decode"]).create()`` gives each name its own network stack
(a namespace with loopback and one interface) and an address from 198.18.0.0/15, the range
reserved for benchmarking networks (RFC 2544), on a bridge in this namespace, which also gets
an address: this process reaches every host, and every host reaches every other. A process
started in a host (``popen``, ``argv``) binds and connects from that host's address only, so an
address that leaks (127.0.0.1 advertised to another host, a listener bound to loopback) fails
as it would across machines.

Faults, each undone by its ``restore_*``:
- ``cut(name)``: the host's link goes down; it reaches nobody and nobody reaches it, silently
  (no reset, no ICMP), as when a cable or a switch port dies;
- ``cut_between(a, b)``: ``a`` and ``b`` no longer reach each other, each still reaching every
  other host (each side resolves the other's address to a MAC no one owns; frames vanish).

``remove()`` kills every process left in the hosts and deletes what ``create`` made; it runs
at interpreter exit too, and ``create`` first removes what a killed earlier run left behind.
Needs root and iproute2 (``available()`` says why not). No ``netem`` here: no delay or loss.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.launcher import Placement

_NETWORK = ipaddress.ip_network("198.18.0.0/15")
# One /24 per network (a token's byte picks it), hosts from .10: 198.18.<n>.10, .11, ...
_FIRST_HOST = 10
_PREFIX = "ssh"  # every namespace, bridge and veth this module makes starts with it
_REGISTRY = Path("/tmp/splitserve-netns")  # <token>: the pid of the process that made it
_NOWHERE_MAC = "02:00:00:00:00:01"  # locally administered, owned by no interface
# Between namespaces of one machine UCX (nixl, ucx) would pick shared memory; between machines
# without RDMA it uses TCP. Processes on test hosts get this, so that KV crosses the network.
UCX_ACROSS_HOSTS = {"UCX_TLS": "tcp,self"}
_KILL_WAIT_S = 5.0


def available() -> str | None:
    """None if this process can make test hosts, else why not (for ``pytest.skip``)."""
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces)"
    try:
        subprocess.run(["ip", "netns", "list"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"test hosts need iproute2's ip netns: {exc}"
    return None


@dataclass(frozen=True, slots=True)
class Host:
    """One test host: its namespace, its address and the bridge port of its link."""

    name: str
    netns: str
    address: str
    link: str  # the veth end on the bridge, in this namespace: down = cut


class HostNetwork:
    """Test hosts named ``names`` on one bridge (see the module docstring)."""

    def __init__(self, names: Sequence[str]) -> None:
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be distinct and non-empty: {names}")
        self.token = secrets.token_hex(2)
        subnet = list(_NETWORK.subnets(new_prefix=24))[int(self.token, 16) % 512]
        self.gateway = str(subnet[1])  # this namespace's address on the bridge
        self.prefix_len = subnet.prefixlen
        self.bridge = f"{_PREFIX}{self.token}br"
        self.hosts = {
            name: Host(
                name,
                f"{_PREFIX}{self.token}-{name}",
                str(subnet[_FIRST_HOST + i]),
                f"{_PREFIX}{self.token}v{i}",
            )
            for i, name in enumerate(names)
        }
        self._created = False

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def create(self) -> HostNetwork:
        """Make the bridge and the hosts (removing what dead earlier runs left); returns self.
        On failure, removes what it made and raises."""
        remove_stale()
        _REGISTRY.mkdir(exist_ok=True)
        (_REGISTRY / self.token).write_text(str(os.getpid()))
        self._created = True
        atexit.register(self.remove)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/{self.prefix_len}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for host in self.hosts.values():
                _ip("netns", "add", host.netns)
                inner = f"{host.link}i"
                _ip("link", "add", host.link, "type", "veth", "peer", "name", inner)
                _ip("link", "set", inner, "netns", host.netns)
                _ip("link", "set", host.link, "master", self.bridge)
                _ip("link", "set", host.link, "up")
                self._in(host, "ip", "link", "set", "lo", "up")
                self._in(host, "ip", "link", "set", inner, "name", "eth0")
                self._in(
                    host, "ip", "addr", "add", f"{host.address}/{self.prefix_len}", "dev", "eth0"
                )
                self._in(host, "ip", "link", "set", "eth0", "up")
        except BaseException:
            self.remove()
            raise
        return self

    def placement(self, name: str) -> Placement:
        """Where a ``LocalCluster`` process runs on host ``name``."""
        return Placement(self.hosts[name].address, tuple(self.argv(name, [])))

    def argv(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``name`` (``ip netns exec``: the same process, exec'd)."""
        return ["ip", "netns", "exec", self.hosts[name].netns, *argv]

    def popen(self, name: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside host ``name`` (``kwargs`` go to ``subprocess.Popen``)."""
        return subprocess.Popen(self.argv(name, argv), **kwargs)

    def run(self, name: str, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside host ``name`` to completion (``check`` defaults to True)."""
        kwargs.setdefault("check", True)
        return subprocess.run(self.argv(name, argv), **kwargs)

    def cut(self, name: str) -> None:
        """Take host ``name``'s link down: every packet to or from it is lost from now on."""
        _ip("link", "set", self.hosts[name].link, "down")

    def restore(self, name: str) -> None:
        _ip("link", "set", self.hosts[name].link, "up")

    def cut_between(self, a: str, b: str) -> None:
        """``a`` and ``b`` stop reaching each other (both ways); each still reaches the rest."""
        for src, dst in ((a, b), (b, a)):
            self._in(
                self.hosts[src], "ip", "neigh", "replace", self.hosts[dst].address,
                "lladdr", _NOWHERE_MAC, "dev", "eth0", "nud", "permanent",
            )  # fmt: skip

    def restore_between(self, a: str, b: str) -> None:
        for src, dst in ((a, b), (b, a)):
            self._in(self.hosts[src], "ip", "neigh", "del", self.hosts[dst].address, "dev", "eth0")

    def pids(self, name: str) -> list[int]:
        """The processes running inside host ``name``."""
        out = subprocess.run(
            ["ip", "netns", "pids", self.hosts[name].netns], capture_output=True, text=True
        ).stdout
        return [int(pid) for pid in out.split()]

    def remove(self) -> None:
        """Kill every process inside the hosts and delete the hosts and the bridge. Idempotent;
        never raises."""
        if not self._created:
            return
        self._created = False
        with contextlib.suppress(Exception):
            atexit.unregister(self.remove)
        _remove_token(self.token)

    def __enter__(self) -> HostNetwork:
        return self.create()

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def _in(self, host: Host, *argv: str) -> None:
        subprocess.run(["ip", "netns", "exec", host.netns, *argv], check=True, capture_output=True)


@contextlib.contextmanager
def ucx_across_hosts() -> Iterator[None]:
    """``UCX_ACROSS_HOSTS`` in this process's environment (which the processes it starts
    inherit) until the block ends, then the environment as it was."""
    saved = {key: os.environ.get(key) for key in UCX_ACROSS_HOSTS}
    os.environ.update(UCX_ACROSS_HOSTS)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def leftovers() -> list[str]:
    """Namespaces and links this module made that still exist (for a cleanup check)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found = [n for n in names if n.startswith(_PREFIX)]
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(_PREFIX):
            found.append(name)
    return found


def remove_stale() -> None:
    """Remove the hosts of runs whose process is gone (killed before it could clean up)."""
    if not _REGISTRY.is_dir():
        return
    for entry in _REGISTRY.iterdir():
        try:
            pid = int(entry.read_text())
            os.kill(pid, 0)
        except (ValueError, ProcessLookupError, PermissionError, OSError):
            _remove_token(entry.name)


def _remove_token(token: str) -> None:
    namespaces = [
        n
        for n in subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True
        ).stdout.split()
        if n.startswith(f"{_PREFIX}{token}-")
    ]
    pids: list[int] = []
    for netns in namespaces:
        out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
        pids += [int(p) for p in out.stdout.split()]
    _kill_all([pid for pid in pids if pid != os.getpid()])
    for netns in namespaces:
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)
    for line in subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True
    ).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(f"{_PREFIX}{token}"):
            subprocess.run(["ip", "link", "del", name], capture_output=True)
    with contextlib.suppress(OSError):
        (_REGISTRY / token).unlink()


def _kill_all(pids: list[int]) -> None:
    """SIGTERM, then SIGKILL what is still there after ``_KILL_WAIT_S``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline_s = time.monotonic() + _KILL_WAIT_S
        while pids and time.monotonic() < deadline_s:
            pids = [p for p in pids if is_alive(p)]
            time.sleep(0.05)
        if not pids:
            return


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    return False


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True)
