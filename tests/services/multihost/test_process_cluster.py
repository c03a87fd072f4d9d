"""A cluster of plain processes across test hosts: the router, the prefill worker, two decode
workers and Redis each on a host of its own, KV over tcp, then over nixl (UCX over TCP). Every
address a worker advertises is its host's own and reachable from the other hosts (nixl's
peer address is its agent's name); greedy output equals the offline engine;
and under partitions (a decode host cut mid-stream, a prefill host cut during a KV pull, the
Redis host cut, the router cut from one decode host only) every stream ends token-exact and
none hangs."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Callable

import pytest

from engine import LLM, SamplingParams
from kvtransfer.registry import is_available
from loadtest.fixtures.netns_hosts import ucx_across_hosts
from loadtest.fixtures.redis_server import RedisServer
from services.common.convert import sampling_params_to_worker
from services.common.roles import Role
from services.launcher import LocalCluster, Placement
from splitserve.v1 import router_pb2, worker_pb2
from tests.services.conftest import NUM_KV_BLOCKS, Client, greedy, scrape, tiny_engine_config
from tests.services.worker_calls import Workers
from tests.waiting import wait_until

HOSTS = ("router", "prefill", "decode0", "decode1", "redis")
KV_IO_TIMEOUT_S = 3.0
# The router fences a worker after 2 failed polls, each up to 0.5 s apart plus a 2 s timeout;
# the stream then moves and the new worker recomputes: a stall past this is a hang.
MIGRATION_BOUND_S = 15.0
STREAM_TOKENS = 200
REDIS_PASSWORD = "multihost"


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture(scope="module")
def hosts(host_network):
    return host_network(HOSTS)


@pytest.fixture(scope="module")
def redis(hosts, tmp_path_factory):
    server = RedisServer(
        tmp_path_factory.mktemp("redis"),
        password=REDIS_PASSWORD,  # bound off loopback, Redis refuses clients without one
        host=hosts["redis"].address,
        argv_prefix=hosts.argv("redis", []),
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module", params=[b for b in ("tcp", "nixl") if is_available(b)])
def cluster(request, hosts, redis, tiny_llama_dir):
    def place(role: Role, index: int) -> Placement:
        return hosts.placement(
            {Role.ROUTER: "router", Role.PREFILL: "prefill"}.get(role, f"decode{index}")
        )

    redis_flags = ("--redis-url", redis.url, "--redis-password", REDIS_PASSWORD)
    local = LocalCluster(
        engine=tiny_engine_config(tiny_llama_dir),
        num_decode=2,
        placement=place,
        extra_worker_flags=(
            *redis_flags, "--kv-transfer", request.param,
            "--kv-io-timeout-s", str(KV_IO_TIMEOUT_S),
            "--heartbeat-ttl-s", "1", "--shutdown-grace-s", "2",
        ),
        extra_router_flags=(*redis_flags, "--local-prefill-max-tokens", "0"),
    )  # fmt: skip
    try:
        with ucx_across_hosts():  # the processes take the environment they start with
            local.start(timeout_s=180)
        client = Client(local.router_address)
        yield local, client
        client.close()
    finally:
        local.stop()


def connects(hosts, host: str, address: str) -> bool:
    """A TCP connect to ``address`` from inside ``host`` succeeds within 2 s."""
    ip, port = address.rsplit(":", 1)
    code = f"import socket; socket.create_connection(({ip!r}, {port}), timeout=2).close()"
    run = hosts.run(host, [sys.executable, "-c", code], capture_output=True, check=False)
    return run.returncode == 0


def stream(client: Client, prompt: list[int], on_token=None) -> tuple[list[int], float]:
    """Greedy ``STREAM_TOKENS`` tokens of ``prompt``; the tokens and the longest gap between
    two messages (s). ``on_token(num_tokens_so_far)`` runs after each message."""
    call = client.stub.Generate(
        router_pb2.GenerateRequest(
            token_ids=prompt, sampling=greedy(STREAM_TOKENS, ignore_eos=True)
        ),
        timeout=120,
    )
    tokens: list[int] = []
    longest_gap_s, last_s = 0.0, time.monotonic()
    for message in call:
        now_s = time.monotonic()
        longest_gap_s, last_s = max(longest_gap_s, now_s - last_s), now_s
        tokens.extend(message.token_ids)
        if on_token is not None:
            on_token(len(tokens))
    return tokens, longest_gap_s


def busy_decode_host(client: Client, local: LocalCluster) -> tuple[str, str]:
    """The decode worker running a request: its address and its host's name."""
    busy = [w.address for w in client.status().workers if w.role == 2 and w.load.num_running]
    assert len(busy) == 1, busy
    index = [p.address for p in local.workers("decode")].index(busy[0])
    return busy[0], f"decode{index}"


def healthy_again(client: Client, address: str) -> None:
    def healthy() -> bool:
        return any(w.address == address and w.healthy for w in client.status().workers)

    wait_until(healthy, 60, f"{address} healthy again after the link returned", 0.2)


def idle(client: Client, address: str) -> None:
    """Wait until the worker at ``address`` runs nothing (its stale stream was aborted)."""

    def quiet() -> bool:
        return any(
            w.address == address and w.healthy and not w.load.num_running
            for w in client.status().workers
        )

    wait_until(quiet, 60, f"{address} running nothing", 0.2)


def prompt_of(seed: int, length: int = 60) -> list[int]:
    return [(seed * 31 + i * 7) % 480 + 3 for i in range(length)]


def test_every_worker_advertises_its_own_hosts_reachable_addresses(hosts, cluster):
    local, client = cluster
    workers = client.status().workers
    assert len(workers) == 3 and all(w.healthy for w in workers)
    expected = {p.address: p for p in (*local.workers("prefill"), *local.workers("decode"))}
    for worker in workers:
        ip = worker.address.rsplit(":", 1)[0]
        assert worker.address in expected
        assert not ip.startswith("127.") and ip in {h.address for h in hosts.hosts.values()}
        # nixl's peer address is its agent's name (its UCX addresses travel in the metadata).
        kv_addresses = (
            [] if worker.info.kv_transfer_backend == "nixl" else [worker.info.kv_peer.address]
        )
        assert all(a.rsplit(":", 1)[0] == ip for a in kv_addresses)
        others = [name for name, h in hosts.hosts.items() if h.address != ip]
        for other in others[:2]:
            for address in (worker.address, *kv_addresses):
                assert connects(hosts, other, address), (other, address)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", int(workers[0].address.rsplit(":", 1)[1])), 1)


def test_greedy_output_across_hosts_equals_the_offline_engine(cluster, offline):
    _, client = cluster
    prompts = [prompt_of(seed, length) for seed, length in ((1, 5), (2, 40), (3, 97))]
    want = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    for prompt, expected in zip(prompts, want, strict=True):
        got = client.generate(token_ids=prompt, sampling=greedy(12))
        assert got.token_ids == expected.token_ids
        assert got.last.usage.prompt_tokens == len(prompt)


def stream_through_a_cut(
    client: Client, local: LocalCluster, offline: LLM, seed: int, cut: Callable[[str], None]
) -> tuple[str, str]:
    """Stream a greedy ``STREAM_TOKENS``-token request; once 20 tokens arrived, ``cut`` the
    host of the decode worker serving it. The stream must end token-exact without a stall
    past ``MIGRATION_BOUND_S``; returns that worker's address and host."""
    prompt = prompt_of(seed)
    want = offline.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=STREAM_TOKENS, ignore_eos=True)
    )[0].token_ids
    victims: list[tuple[str, str]] = []

    def cut_at_20(num_tokens: int) -> None:
        if not victims and num_tokens >= 20:
            victims.append(busy_decode_host(client, local))
            cut(victims[0][1])

    tokens, longest_gap_s = stream(client, prompt, cut_at_20)
    assert victims and tokens == want
    assert longest_gap_s < MIGRATION_BOUND_S
    return victims[0]


def test_a_decode_host_cut_mid_stream_is_fenced_and_its_stream_moves(hosts, cluster, offline):
    local, client = cluster
    address, host = stream_through_a_cut(client, local, offline, 4, hosts.cut)
    assert not next(w for w in client.status().workers if w.address == address).healthy
    hosts.restore(host)
    healthy_again(client, address)
    idle(client, address)  # the stream it kept generating while cut off was aborted
    prompt = prompt_of(4)
    want = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert client.generate(token_ids=prompt, sampling=greedy(8)).token_ids == want.token_ids


def test_the_router_cut_from_one_decode_host_only_hangs_no_stream(hosts, cluster, offline):
    local, client = cluster

    def cut_from_router(host: str) -> None:
        hosts.cut_between("router", host)

    address, host = stream_through_a_cut(client, local, offline, 5, cut_from_router)
    # The decode host still reaches the prefill host and Redis: only the router lost it.
    assert connects(hosts, host, local.workers("prefill")[0].address)
    hosts.restore_between("router", host)
    healthy_again(client, address)
    idle(client, address)


def test_a_prefill_host_cut_during_the_kv_pull_is_recomputed(hosts, cluster, offline):
    """And once the link is back, the next pull from that prefill worker moves its KV."""
    local, client = cluster
    prompt = prompt_of(6, 90)
    want = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10))[0]
    workers = Workers(local.workers("prefill")[0], local.workers("decode")[0])
    try:
        sampling = sampling_params_to_worker(SamplingParams(temperature=0, max_tokens=10))
        first = workers.prefill_only("cut-during-pull", prompt, max_tokens=10)
        hosts.cut("prefill")
        start_s = time.monotonic()
        try:
            token_ids, last = workers.decode_with("cut-during-pull", prompt, sampling, first)
        finally:
            hosts.restore("prefill")
        assert time.monotonic() - start_s < KV_IO_TIMEOUT_S + 10
        assert last.kv_transfer_failed and last.num_transferred_blocks == 0
        assert token_ids == want.token_ids

        def retired() -> worker_pb2.WorkerLoad | None:
            load = workers.decode.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
            return None if load.num_running else load

        assert wait_until(retired, 10, "the decode engine retiring the request").num_running == 0
        healthy_again(client, local.workers("prefill")[0].address)
        after = prompt_of(12, 50)
        token_ids, last = workers.prefill_then_decode("after-the-cut", after, 6)
        assert not last.kv_transfer_failed and last.num_transferred_blocks == 4
        want = offline.generate([after], SamplingParams(temperature=0.0, max_tokens=6))[0]
        assert token_ids == want.token_ids
    finally:
        workers.close()


def test_with_the_redis_host_cut_routing_goes_on_and_the_index_is_rebuilt(
    hosts, cluster, redis, offline
):
    import redis as redis_client

    local, client = cluster
    router = local.workers("router")[0]
    errors = ("splitserve_router_prefix_index_errors_total", ())
    errors_before = scrape(router.metrics_port, hosts["router"].address)[errors]
    prompts = [prompt_of(seed, 70) for seed in range(7, 11)]
    want = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    hosts.cut("redis")
    try:
        results: list[list[int]] = [[] for _ in prompts]

        def run(i: int) -> None:
            results[i] = client.generate(token_ids=prompts[i], sampling=greedy(6)).token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert results == [w.token_ids for w in want]
        # Each routing decision found the index unreachable and went by load alone.
        errors_after = scrape(router.metrics_port, hosts["router"].address)[errors]
        assert errors_after - errors_before >= len(prompts)
    finally:
        hosts.restore("redis")
    index = redis_client.Redis.from_url(redis.url, **redis.client_options())

    def republished() -> bool:
        return bool(index.keys("splitserve:worker:*"))

    index.flushall()  # as if Redis had lost everything while cut off
    wait_until(republished, 30, "the workers publishing their index again", 0.2)
    index.close()
    got = client.generate(token_ids=prompts[0], sampling=greedy(6))
    assert got.token_ids == want[0].token_ids
    assert got.last.usage.cached_tokens > 0
