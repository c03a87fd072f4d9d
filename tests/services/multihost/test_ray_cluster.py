"""``splitserve up`` on a Ray cluster across test hosts, as README's multi-machine recipe runs
it: the Ray head (controller, router) on one host, prefill and decode nodes on hosts of their
own, Redis on another, KV over nixl (UCX over TCP) between the hosts. Actors land on the hosts
of their pool and advertise addresses the other hosts reach; greedy output equals the offline
engine; ``splitserve scale prefill 2`` grows onto the second prefill host; and when a decode
host's processes all die (node loss), its stream finishes token-exact and the controller
replaces the worker on the surviving decode host."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from loadtest.fixtures.redis_server import RedisServer
from splitserve.v1 import router_pb2
from tests.services.conftest import NUM_KV_BLOCKS, Client, greedy
from tests.services.multihost.ray_nodes import RayHosts
from tests.waiting import wait_until

HOSTS = ("head", "prefill0", "prefill1", "decode0", "decode1", "redis")
REDIS_PASSWORD = "multihost"
STREAM_TOKENS = 200
POOL_OF_HOST = {f"{pool}{i}": pool for pool in ("prefill", "decode") for i in (0, 1)}
PREFILL, DECODE = 1, 2


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture(scope="module")
def ray_hosts(host_network, tiny_llama_dir, tmp_path_factory):
    network = host_network(HOSTS)
    redis = RedisServer(
        tmp_path_factory.mktemp("redis"),
        password=REDIS_PASSWORD,
        host=network["redis"].address,
        argv_prefix=network.argv("redis", []),
    )
    redis.start()
    # Ray's socket paths must stay under 107 bytes: a short temporary directory.
    work_dir = Path(tempfile.mkdtemp(prefix="ssray-"))
    nodes = RayHosts(network, "head", work_dir)
    try:
        nodes.start_head()
        for host, pool in POOL_OF_HOST.items():
            nodes.start_node(host, {pool: 1})
        nodes.splitserve_up(
            str(tiny_llama_dir),
            (
                "--dtype", "float32", "--num-kv-blocks", str(NUM_KV_BLOCKS), "--num-threads", "1",
                "--kv-transfer", "nixl", "--redis-url", redis.url,
                "--redis-password", REDIS_PASSWORD, "--local-prefill-max-tokens", "0",
                "--heartbeat-ttl-s", "1", "--shutdown-grace-s", "2",
            ),
        )  # fmt: skip
        client = Client(nodes.router_address)
        yield network, nodes, client
        client.close()
    finally:
        nodes.stop_up()
        redis.stop()
        network.remove()  # Ray's processes, before their directory goes
        shutil.rmtree(work_dir, ignore_errors=True)


def workers_of(client: Client, role: int) -> list[router_pb2.WorkerStatus]:
    return [w for w in client.status().workers if w.role == role]


def host_of(network, address: str) -> str:
    ip = address.rsplit(":", 1)[0]
    return next(name for name, host in network.hosts.items() if host.address == ip)


def test_actors_land_on_the_hosts_of_their_pool_with_reachable_addresses(ray_hosts):
    """(nixl's peer address is its agent's name: its UCX addresses travel in the metadata,
    and the transfers of the next test cross the hosts through them.)"""
    network, nodes, client = ray_hosts
    assert nodes.router_address.startswith(network["head"].address)
    status = client.status()
    placed = sorted((w.role, host_of(network, w.address)) for w in status.workers)
    assert len(placed) == 2
    assert placed[0][0] == PREFILL and placed[0][1] in ("prefill0", "prefill1")
    assert placed[1][0] == DECODE and placed[1][1] in ("decode0", "decode1")
    code = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 2)"
    for worker in status.workers:
        ip, port = worker.address.rsplit(":", 1)
        for other in ("head", "redis"):
            network.run(other, [sys.executable, "-c", code, ip, port], timeout=30)


def test_greedy_output_across_hosts_over_nixl_equals_the_offline_engine(ray_hosts, offline):
    _, _, client = ray_hosts
    prompts = [[(s * 13 + i * 5) % 480 + 3 for i in range(n)] for s, n in ((1, 9), (2, 57))]
    want = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    for prompt, expected in zip(prompts, want, strict=True):
        got = client.generate(token_ids=prompt, sampling=greedy(12))
        assert got.token_ids == expected.token_ids
        assert got.last.usage.prompt_tokens == len(prompt)
    decode = workers_of(client, DECODE)[0]
    assert decode.info.kv_transfer_backend == "nixl"
    assert decode.load.num_transfers_failed == 0


def test_scale_prefill_2_grows_onto_the_second_prefill_host(ray_hosts):
    network, nodes, client = ray_hosts
    scaled = subprocess.run(
        [sys.executable, "-m", "services.cli", "scale", "prefill", "2", "--wait",
         "--target", nodes.router_address, "--timeout-s", "180"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert scaled.returncode == 0, scaled.stderr
    hosts = sorted(host_of(network, w.address) for w in workers_of(client, PREFILL))
    assert hosts == ["prefill0", "prefill1"]


def test_node_loss_mid_stream_finishes_the_stream_and_replaces_the_worker(ray_hosts, offline):
    network, _, client = ray_hosts
    prompt = [(i * 11) % 480 + 3 for i in range(60)]
    want = offline.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=STREAM_TOKENS, ignore_eos=True)
    )[0].token_ids
    lost: list[str] = []
    call = client.stub.Generate(
        router_pb2.GenerateRequest(
            token_ids=prompt, sampling=greedy(STREAM_TOKENS, ignore_eos=True)
        ),
        timeout=120,
    )
    tokens: list[int] = []
    for message in call:
        tokens.extend(message.token_ids)
        if not lost and len(tokens) >= 20:
            host = host_of(network, workers_of(client, DECODE)[0].address)
            network.run(host, ["kill", "-9", *map(str, network.pids(host))])
            lost.append(host)
    assert lost and tokens == want
    survivor = "decode1" if lost[0] == "decode0" else "decode0"

    def replaced() -> bool:
        ready = [w for w in workers_of(client, DECODE) if w.healthy]
        return bool(ready) and all(host_of(network, w.address) == survivor for w in ready)

    wait_until(replaced, 120, f"the decode worker replaced on {survivor}", 1.0)
    got = client.generate(token_ids=prompt, sampling=greedy(8))
    assert got.token_ids == want[:8]


def test_with_no_decode_host_left_the_pool_is_reported_short_with_the_reason(ray_hosts):
    """Runs last: it ends every decode host."""
    network, _, client = ray_hosts
    for host in ("decode0", "decode1"):
        pids = network.pids(host)
        if pids:
            network.run(host, ["kill", "-9", *map(str, pids)])

    def short() -> router_pb2.PoolStatus | None:
        pool = next(p for p in client.status().pools if p.role == DECODE)
        return pool if pool.num_ready == 0 and "wait for a node" in pool.last_error else None

    pool = wait_until(short, 60, lambda: f"the decode pool reported short: {client.status()}", 1.0)
    assert pool.desired_workers == 1
    assert "offer 0 'decode' slots" in pool.last_error
