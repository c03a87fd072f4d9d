"""The faults ``loadtest.chaos.matrix`` injects, one per phase, and how each is undone.

Each ``Fault`` acts on a running ``ChaosCluster`` while the phase's load is in flight
(``inject``) and brings the cluster back once the load has ended (``recover``): a killed worker
is restarted by the launcher's supervision, a stopped process is continued, a killed router is
started again. ``side_load`` sends the fault's own requests next to the load (fuzzed ones, slow
readers) and returns their statuses.
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from splitserve.v1 import router_pb2, router_pb2_grpc

if TYPE_CHECKING:
    from loadtest.chaos.matrix import ChaosCluster
    from loadtest.fixtures.netns_hosts import HostNetwork

GENERATE_METHOD = "/splitserve.v1.Router/Generate"
# How long a SIGSTOPped process stays stopped: longer than the router's fencing and keepalive.
STOP_S = 20.0
_SLOW_READER_OPTIONS = (("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0))


class Target(enum.Enum):
    """Which process of the cluster a fault hits."""

    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"


@dataclass(frozen=True, slots=True)
class Fault:
    """One phase's fault. ``inject`` runs once the load is under way."""

    name: str
    inject: Callable[[ChaosCluster], None] = lambda cluster: None
    recover: Callable[[ChaosCluster], None] = lambda cluster: None
    side_load: Callable[[ChaosCluster], list[str]] | None = None
    notes: str = ""
    needs_hosts: bool = False  # a network fault: only with ``--hosts``


def _signal(target: Target, sig: signal.Signals) -> Callable[[ChaosCluster], None]:
    def inject(cluster: ChaosCluster) -> None:
        cluster.victim(target).signal(sig)

    return inject


def _stop_then_continue(target: Target) -> Callable[[ChaosCluster], None]:
    """SIGSTOP now, SIGCONT after ``STOP_S`` (on a timer: the load keeps running meanwhile)."""

    def inject(cluster: ChaosCluster) -> None:
        process = cluster.victim(target)
        process.signal(signal.SIGSTOP)
        threading.Timer(STOP_S, process.signal, (signal.SIGCONT,)).start()

    return inject


def _network(cluster: ChaosCluster) -> HostNetwork:
    assert cluster.network is not None, "a network fault needs --hosts"
    return cluster.network


def _cut_host(target: Target | None) -> tuple[Callable[[ChaosCluster], None], ...]:
    """Cut the victim's host (Redis's for None) off the network; restore it after the load."""

    def host(cluster: ChaosCluster) -> str:
        return "redis" if target is None else cluster.victim_host(target)

    def inject(cluster: ChaosCluster) -> None:
        _network(cluster).cut(host(cluster))

    def recover(cluster: ChaosCluster) -> None:
        _network(cluster).restore(host(cluster))

    return inject, recover


def _partition_router_from_decode(cluster: ChaosCluster) -> None:
    _network(cluster).cut_between(
        cluster.victim_host(Target.ROUTER), cluster.victim_host(Target.DECODE)
    )


def _heal_router_from_decode(cluster: ChaosCluster) -> None:
    _network(cluster).restore_between(
        cluster.victim_host(Target.ROUTER), cluster.victim_host(Target.DECODE)
    )


def _lose_decode_host(cluster: ChaosCluster) -> None:
    """The host goes dark and every process on it dies (a node lost); recovery brings the
    host back and the launcher restarts its worker there (a node replaced)."""
    network, host = _network(cluster), cluster.victim_host(Target.DECODE)
    network.cut(host)
    for pid in network.pids(host):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _restart_redis(cluster: ChaosCluster) -> None:
    cluster.redis.stop()
    time.sleep(2.0)
    cluster.redis.start()


def _fuzzed_requests(cluster: ChaosCluster) -> list[str]:
    """Non-finite floats in every sampling field, garbage bytes, oversized and empty inputs:
    each must get INVALID_ARGUMENT."""
    requests: list[router_pb2.GenerateRequest | bytes] = []
    for field_descriptor in router_pb2.SamplingParams.DESCRIPTOR.fields:
        if field_descriptor.cpp_type == field_descriptor.CPPTYPE_FLOAT:
            for value in (math.nan, math.inf, -math.inf):
                sampling = router_pb2.SamplingParams(max_tokens=8, temperature=1.0)
                setattr(sampling, field_descriptor.name, value)
                requests.append(router_pb2.GenerateRequest(token_ids=[5, 6], sampling=sampling))
    rng = random.Random(0)
    requests += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) for _ in range(20)]
    requests += [
        router_pb2.GenerateRequest(prompt="x" * (4 * 2**20 + 1)),
        router_pb2.GenerateRequest(),
        router_pb2.GenerateRequest(token_ids=[10**9]),
    ]
    channel = cluster.channel(0)
    generate = channel.unary_stream(GENERATE_METHOD)
    statuses = []
    for request in requests:
        body = request if isinstance(request, bytes) else request.SerializeToString()
        try:
            for _ in generate(body, timeout=30):
                pass
            statuses.append("OK")
        except grpc.RpcError as exc:
            statuses.append(exc.code().name)
    return statuses


def _slow_readers(cluster: ChaosCluster) -> list[str]:
    """Clients that read one message and then nothing for twice the workers' stream idle
    timeout, over channels with a tiny receive window (so that flow control reaches back)."""
    statuses: list[str] = []

    def stall(i: int) -> None:
        address = cluster.local.workers("router")[i % 2].address
        channel = grpc.insecure_channel(address, options=_SLOW_READER_OPTIONS)
        stub = router_pb2_grpc.RouterStub(channel)
        request = router_pb2.GenerateRequest(
            token_ids=[7 + i] * 12,
            sampling=router_pb2.SamplingParams(
                max_tokens=cluster.max_model_len - 12, temperature=0.0, ignore_eos=True, logprobs=5
            ),
        )
        call = stub.Generate(request, timeout=120)
        try:
            next(call)
            time.sleep(2 * cluster.stream_idle_timeout_s)
            for _ in call:
                pass
            statuses.append("OK")
        except grpc.RpcError as exc:
            statuses.append(exc.code().name)
        finally:
            call.cancel()
            channel.close()

    threads = [threading.Thread(target=stall, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statuses


def _restart_router(cluster: ChaosCluster) -> None:
    cluster.restart_router(cluster.victim(Target.ROUTER))


FAULTS: tuple[Fault, ...] = (
    Fault("none"),
    Fault("kill -9 prefill", _signal(Target.PREFILL, signal.SIGKILL)),
    Fault("kill -9 decode", _signal(Target.DECODE, signal.SIGKILL)),
    Fault(
        "kill -9 router",
        _signal(Target.ROUTER, signal.SIGKILL),
        _restart_router,
        notes="its clients' streams end UNAVAILABLE (a client retries on another router)",
    ),
    Fault("SIGSTOP prefill", _stop_then_continue(Target.PREFILL)),
    Fault("SIGSTOP decode", _stop_then_continue(Target.DECODE)),
    Fault(
        "SIGSTOP router",
        _stop_then_continue(Target.ROUTER),
        notes="its clients' keepalive ends their streams UNAVAILABLE",
    ),
    Fault("SIGTERM decode", _signal(Target.DECODE, signal.SIGTERM)),
    Fault("redis stop/start", _restart_redis),
    Fault("fuzzed requests", side_load=_fuzzed_requests),
    Fault("slow readers", side_load=_slow_readers),
    Fault("decode host cut", *_cut_host(Target.DECODE), needs_hosts=True),
    Fault(
        "prefill host cut",
        *_cut_host(Target.PREFILL),
        notes="pulls from it fail within --kv-io-timeout-s and are recomputed",
        needs_hosts=True,
    ),
    Fault("redis host cut", *_cut_host(None), needs_hosts=True),
    Fault(
        "router cut from a decode host",
        _partition_router_from_decode,
        _heal_router_from_decode,
        notes="the last router and the last decode host lose each other only",
        needs_hosts=True,
    ),
    Fault(
        "decode host lost",
        _lose_decode_host,
        lambda cluster: _network(cluster).restore(cluster.victim_host(Target.DECODE)),
        notes="every process of the host killed, the host cut until the load ends",
        needs_hosts=True,
    ),
)


@dataclass(slots=True)
class PhaseResult:
    """What one phase's load (and the fault's own requests) got."""

    fault: str
    sent: int = 0
    exact: int = 0
    wrong: int = 0  # completed, but not the reference's tokens
    failed: dict[str, int] = field(default_factory=dict)  # status code -> count
    lost: int = 0  # ended without a finish reason and without a status
    hung: int = 0  # still open at the client's deadline
    side: dict[str, int] = field(default_factory=dict)  # the fault's own requests, by status
    notes: str = ""
    load_s: float = 0.0  # from the first request sent to the last one ended
    recover_s: float = 0.0  # from then until the cluster served again, every worker healthy
