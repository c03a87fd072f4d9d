"""KV transfer throughput per backend between two processes, beside a memcpy bound.

``python -m loadtest.bench.kv_transfer [--backends nixl,ucx,tcp,ucx+tls,tcp+tls]
[--sizes-mib 1,16,64,256] [--model smollm2-135m] [--prompt-tokens 2000]
[--kv-cache-dtype bfloat16|int8|fp8_e4m3] [--repeats 5] [--out DIR]``

``NAME+tls`` runs backend NAME with mutual TLS on every connection (``kvtransfer.tls``), under
certificates ``splitserve certs`` writes to ``DIR/kv-certs``.

For each backend a source process registers a cache shaped like SmolLM2-135M's (30 layers,
3 KV heads, head_dim 64, 16-token blocks, bf16: 360 KiB per block) and this process, the
destination, reads from it through the backend's normal path (``start_read`` / ``poll``):

- **sizes**: 1, 16, 64 and 256 MiB as whole blocks at scattered source and destination ids
  (a randomly permuted block pool, the layout after churn); each read's bytes are checked;
- **real KV**: the source loads ``--model`` in bfloat16 with a ``--kv-cache-dtype`` cache,
  prefills one ``--prompt-tokens`` prompt with its KV held (what a prefill worker does),
  publishes its blocks, and the destination reads them;
  ``transfer share of TTFT`` = read time / (prefill time + read time);
- **memcpy bound**: in the same run, a torch copy of the same number of bytes between two
  preallocated buffers of this process;
- **CMA ceiling** (Linux): the kernel's cross-process copy, ``process_vm_readv`` of the same
  blocks from the source process straight into the destination blocks, which is what UCX uses
  between two processes of one host without xpmem/knem; no same-host transport that does not
  share a mapping of the source's memory can beat it;
- **first connection**: the backend's ``connection_setup_s`` and the first read's wall time.

With ``--hosts`` (root) every backend runs twice: within one host, as above, then with the
source and the reader on two test hosts (``loadtest.fixtures.netns_hosts``: network namespaces
joined by a bridge), so that the bytes cross a network stack (UCX restricted to TCP there, as
between machines without RDMA).

Before each timed read or copy the CPU caches are flushed by writing a 256 MiB buffer, so
neither side reads cache-hot bytes. Medians of ``--repeats``. Prints a Markdown table and writes
``kv_transfer.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.kv_cache_spec import KVCacheSpec
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kvtransfer.base import KVRef, KVTransferBackend, PeerInfo, TransferState
from kvtransfer.registry import TLS_BACKENDS, available_backends, make_backend
from kvtransfer.tls import KVTransferTls
from loadtest.fixtures import netns_hosts
from loadtest.fixtures.netns_hosts import HostNetwork
from services.certs import write_cluster_certs

SMOLLM2_SPEC = KVCacheSpec(
    num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="bfloat16"
)
MIB = 1 << 20
_CLONE_NEWNET = 0x40000000
_FLUSH = torch.empty(0, dtype=torch.uint8)


def flush_caches() -> None:
    """Write a buffer larger than the last-level cache so the next copy starts cold."""
    global _FLUSH
    if _FLUSH.numel() == 0:
        _FLUSH = torch.empty(256 * MIB, dtype=torch.uint8)
    _FLUSH.fill_(1)


def synthetic_cache(num_blocks: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(num_blocks)
    shape = (num_blocks, *SMOLLM2_SPEC.block_shape)
    return torch.randint(-(2**15), 2**15, shape, generator=generator, dtype=torch.int16).view(
        torch.bfloat16
    )


def rows(kv_cache: torch.Tensor) -> torch.Tensor:
    return kv_cache.view(torch.uint8).view(kv_cache.shape[0], -1)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def cma_read_s(
    pid: int, src_addr: int, dst_rows: torch.Tensor, src_ids: list[int], dst_ids: list[int]
) -> float:
    """Seconds for one ``process_vm_readv`` of blocks ``src_ids`` of the cache at ``src_addr``
    in process ``pid`` into ``dst_rows[dst_ids]`` (one iovec per block on each side)."""
    block_bytes = dst_rows.shape[1]
    libc = ctypes.CDLL(None, use_errno=True)
    local = (_IoVec * len(dst_ids))(*[(dst_rows[i].data_ptr(), block_bytes) for i in dst_ids])
    remote = (_IoVec * len(src_ids))(*[(src_addr + i * block_bytes, block_bytes) for i in src_ids])
    start_s = time.perf_counter()
    copied = libc.process_vm_readv(pid, local, len(dst_ids), remote, len(src_ids), 0)
    elapsed_s = time.perf_counter() - start_s
    if copied != block_bytes * len(src_ids):
        raise OSError(ctypes.get_errno(), "process_vm_readv failed")
    return elapsed_s


@dataclass(frozen=True, slots=True)
class Side:
    """Where one side of a transfer runs: its address, and its test host's namespace (None:
    this machine's own network)."""

    host: str = "127.0.0.1"
    netns: str | None = None


def enter_netns(netns: str | None) -> None:
    """Move the calling thread (and the threads it starts next) into the named network
    namespace (``ip netns``); None stays. Python 3.11 has no ``os.setns``."""
    if netns is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
    finally:
        os.close(fd)


def backend_for(
    spec: str, engine_id: str, identity: str, tls_root: Path, host: str = "127.0.0.1"
) -> KVTransferBackend:
    """``spec`` is a backend name, or ``NAME+tls``: then every connection is mutual TLS under
    the certificates ``splitserve certs`` wrote to ``tls_root``, as ``identity`` (``prefill`` /
    ``decode``). Socket backends listen on ``host``."""
    name, _, tls = spec.partition("+")
    if not tls:
        return make_backend(name, engine_id, host=host)
    peer = "decode" if identity == "prefill" else "prefill"
    tls_config = KVTransferTls.from_dir(tls_root / identity, {peer})
    return make_backend(name, engine_id, host=host, tls=tls_config)


# ----------------------------------------------------------------------------- source process
def source_main(
    conn: Connection,
    backend_name: str,
    num_blocks: int,
    model: str,
    prompt_tokens: int,
    tls_root: Path,
    side: Side,
) -> None:
    """Serve a synthetic cache; on ``real``, also a real engine's cache after one prefill."""
    enter_netns(side.netns)
    torch.set_num_threads(1)
    synthetic = backend_for(backend_name, "bench-synthetic", "prefill", tls_root, side.host)
    cache = synthetic_cache(num_blocks)
    conn.send((synthetic.register_kv_cache(cache, SMOLLM2_SPEC), cache.data_ptr()))
    real: KVTransferBackend | None = None
    while True:
        command, *args = conn.recv()
        if command == "publish":
            conn.send(synthetic.publish(*args))
        elif command == "real":
            real = backend_for(backend_name, "bench-real", "prefill", tls_root, side.host)
            conn.send(held_prefill(real, model, prompt_tokens, args[0]))
        else:
            break
    synthetic.close()
    if real is not None:
        real.close()


def held_prefill(
    backend: KVTransferBackend, model: str, prompt_tokens: int, kv_cache_dtype: str
) -> tuple[PeerInfo, int, KVCacheSpec, list[int], bytes, float, torch.Tensor]:
    """Load ``model`` (bfloat16, a ``kv_cache_dtype`` cache), register its cache, prefill one
    random prompt with its KV held and publish it as ``real``: (info, cache address, spec,
    block ids, the publication's grant, prefill seconds, the blocks' bytes)."""
    engine = LLMEngine(
        EngineConfig(model=model, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, num_threads=1)
    )
    info = backend.register_kv_cache(engine.kv_cache, engine.kv_cache_spec)
    prompt = torch.randint(100, engine.vocab_size, (prompt_tokens,)).tolist()
    start_s = time.perf_counter()
    engine.add_request("real", prompt, SamplingParams(max_tokens=1), hold_kv=True)
    while engine.has_unfinished_requests():
        engine.step()
    prefill_s = time.perf_counter() - start_s
    block_ids = engine.held_kv_block_ids("real")
    grant = backend.publish("real", block_ids)
    expected = rows(engine.kv_cache)[block_ids].clone()
    cache_addr = engine.kv_cache.data_ptr()
    return info, cache_addr, engine.kv_cache_spec, block_ids, grant, prefill_s, expected


# ----------------------------------------------------------------------------- destination
def timed_read(dst: KVTransferBackend, req_id: str, src: KVRef, dst_ids: list[int]) -> float:
    start_s = time.perf_counter()
    dst.start_read(req_id, src, dst_ids)
    while True:
        state = dst.poll().get(req_id, TransferState.PENDING)
        if state is not TransferState.PENDING:
            break
        time.sleep(0.0002)
    elapsed_s = time.perf_counter() - start_s
    if state is not TransferState.DONE:
        raise RuntimeError(f"read {req_id} failed")
    return elapsed_s


def memcpy_s(num_bytes: int, repeats: int) -> float:
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty(num_bytes, dtype=torch.uint8)
    dst.copy_(src)  # fault the pages in: the KV caches are allocated once, ahead of time
    times = []
    for _ in range(repeats):
        flush_caches()
        start_s = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start_s)
    return statistics.median(times)


def bench_backend(
    backend_name: str, args: argparse.Namespace, source_side: Side = Side(), reader: Side = Side()
) -> dict:
    """One backend's reads from a source process at ``source_side``; this process reads as
    ``reader`` (entering its namespace, if any, for the rest of its life)."""
    sizes_mib = [int(s) for s in args.sizes_mib.split(",")]
    num_blocks = max(sizes_mib) * MIB // SMOLLM2_SPEC.block_bytes + 1
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    source = ctx.Process(
        target=source_main,
        args=(
            child_conn, backend_name, num_blocks, args.model, args.prompt_tokens, args.tls_root,
            source_side,
        ),
        daemon=True,
    )  # fmt: skip
    source.start()
    enter_netns(reader.netns)
    try:
        synthetic_info, src_addr = conn.recv()
        expected_rows = rows(synthetic_cache(num_blocks))
        dst = backend_for(backend_name, "bench-dst", "decode", args.tls_root, reader.host)
        dst_cache = torch.zeros((num_blocks, *SMOLLM2_SPEC.block_shape), dtype=torch.bfloat16)
        dst.register_kv_cache(dst_cache, SMOLLM2_SPEC)
        dst.add_peer(synthetic_info)
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        hosts = "two hosts" if source_side.netns else "one host"
        result: dict = {"backend": backend_name, "hosts": hosts, "sizes": []}
        for size_mib in sizes_mib:
            n = max(size_mib * MIB // SMOLLM2_SPEC.block_bytes, 1)
            src_ids, dst_ids = perm[:n], perm[-n:]
            times = []
            for repeat in range(args.repeats + 1):  # the first read of each size is a warmup
                req_id = f"{size_mib}-{repeat}"
                conn.send(("publish", req_id, src_ids))
                grant = conn.recv()
                flush_caches()
                src = KVRef("bench-synthetic", req_id, tuple(src_ids), 0, grant)
                elapsed_s = timed_read(dst, req_id, src, dst_ids)
                if size_mib == sizes_mib[0] and repeat == 0:
                    result["first_read_s"] = elapsed_s
                    result["connection_setup_s"] = dst.connection_setup_s["bench-synthetic"]
                elif repeat:
                    times.append(elapsed_s)
            if not torch.equal(rows(dst_cache)[dst_ids], expected_rows[src_ids]):
                raise RuntimeError(f"{backend_name}: {size_mib} MiB arrived corrupted")
            num_bytes = n * SMOLLM2_SPEC.block_bytes
            cma_times = []
            for _ in range(args.repeats):
                flush_caches()
                cma_times.append(
                    cma_read_s(source.pid, src_addr, rows(dst_cache), src_ids, dst_ids)
                )
            result["sizes"].append(
                {
                    "mib": size_mib,
                    "bytes": num_bytes,
                    "read_s": statistics.median(times),
                    "memcpy_s": memcpy_s(num_bytes, args.repeats),
                    "cma_s": statistics.median(cma_times),
                }
            )
        conn.send(("real", args.kv_cache_dtype))
        real_info, real_addr, spec, block_ids, real_grant, prefill_s, expected = conn.recv()
        real_dst = backend_for(backend_name, "bench-real-dst", "decode", args.tls_root, reader.host)
        real_dtype = torch.uint8 if spec.quantized else torch.bfloat16
        real_cache = torch.zeros((len(block_ids), *spec.block_shape), dtype=real_dtype)
        real_dst.register_kv_cache(real_cache, spec)
        real_dst.add_peer(real_info)
        real_dst_ids = list(range(len(block_ids)))
        src = KVRef("bench-real", "real", tuple(block_ids), args.prompt_tokens, real_grant)
        timed_read(real_dst, "real-warmup", src, real_dst_ids)
        real_times = []
        for repeat in range(args.repeats):
            real_cache.zero_()
            flush_caches()
            real_times.append(timed_read(real_dst, f"real-{repeat}", src, real_dst_ids))
            if not torch.equal(rows(real_cache), expected):
                raise RuntimeError(f"{backend_name}: the real KV arrived corrupted")
        read_s = statistics.median(real_times)
        num_bytes = len(block_ids) * spec.block_bytes
        cma_times = []
        for _ in range(args.repeats):
            flush_caches()
            cma_times.append(
                cma_read_s(source.pid, real_addr, rows(real_cache), block_ids, real_dst_ids)
            )
        result["real"] = {
            "kv_cache_dtype": spec.dtype,
            "prompt_tokens": args.prompt_tokens,
            "blocks": len(block_ids),
            "bytes": num_bytes,
            "read_s": read_s,
            "memcpy_s": memcpy_s(num_bytes, args.repeats),
            "cma_s": statistics.median(cma_times),
            "prefill_s": prefill_s,
            "ttft_share": read_s / (prefill_s + read_s),
        }
        conn.send(("stop",))
        dst.close()
        real_dst.close()
        return result
    finally:
        source.join(timeout=30)
        if source.is_alive():
            source.kill()


def to_markdown(results: list[dict]) -> str:
    lines = [
        "| backend | payload | read ms | GB/s | memcpy GB/s | % of memcpy | CMA GB/s | % of CMA |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        cases = [(f"{s['mib']} MiB", s) for s in result["sizes"]]
        real = result["real"]
        cases.append((f"SmolLM2 {real['kv_cache_dtype']} KV, {real['prompt_tokens']} tokens", real))
        for label, case in cases:
            gbps = case["bytes"] / case["read_s"] / 1e9
            bound = case["bytes"] / case["memcpy_s"] / 1e9
            cma = case["bytes"] / case["cma_s"] / 1e9
            lines.append(
                f"| {_name(result)} | {label} | {case['read_s'] * 1e3:.2f} | {gbps:.2f} "
                f"| {bound:.2f} | {100 * gbps / bound:.0f}% | {cma:.2f} | {100 * gbps / cma:.0f}% |"
            )
    lines += [
        "",
        "| backend | connection setup ms | first read ms | prefill s | transfer share of TTFT |",
        "|---|---:|---:|---:|---:|",
    ]
    for result in results:
        real = result["real"]
        lines.append(
            f"| {_name(result)} | {result['connection_setup_s'] * 1e3:.1f} "
            f"| {result['first_read_s'] * 1e3:.1f} | {real['prefill_s']:.2f} "
            f"| {100 * real['ttft_share']:.1f}% |"
        )
    return "\n".join(lines)


def _name(result: dict) -> str:
    return f"{result['backend']} ({result['hosts']})"


def _across_hosts(backend_name: str, args: argparse.Namespace) -> dict:
    """``bench_backend`` with the source and the reader on two test hosts; the reader is a
    child process (it enters its host's namespace for good), the hosts are made and removed
    here."""
    ctx = multiprocessing.get_context("spawn")
    with HostNetwork(["source", "reader"]) as network:
        source, reader = network["source"], network["reader"]
        sides = (Side(source.address, source.netns), Side(reader.address, reader.netns))
        conn, child_conn = ctx.Pipe()
        child = ctx.Process(target=_read_on_host, args=(child_conn, backend_name, args, *sides))
        child.start()
        try:
            result: dict = conn.recv()
        finally:
            child.join()
    return result


def _read_on_host(
    conn: Connection, backend_name: str, args: argparse.Namespace, source: Side, reader: Side
) -> None:
    conn.send(bench_backend(backend_name, args, source, reader))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    networked = [b for b in available_backends() if b != "inproc"]
    with_tls = [f"{b}+tls" for b in networked if b in TLS_BACKENDS]
    parser.add_argument("--backends", default=",".join(networked + with_tls))
    parser.add_argument("--sizes-mib", default="1,16,64,256")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("bfloat16", "int8", "fp8_e4m3"),
        default="bfloat16",
        help="the real KV's cache dtype (the prefill worker's --kv-cache-dtype)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument(
        "--hosts", action="store_true", help="also across two test hosts (root; see above)"
    )
    args = parser.parse_args(argv)
    if args.hosts and (reason := netns_hosts.available()) is not None:
        parser.error(f"--hosts: {reason}")
    args.tls_root = args.out / "kv-certs"
    if "+tls" in args.backends and not (args.tls_root / "ca.crt").exists():
        write_cluster_certs(args.tls_root, ["localhost", "127.0.0.1"])
    torch.set_num_threads(1)
    results = []
    for name in args.backends.split(","):
        results.append(bench_backend(name, args))
        if args.hosts:
            with netns_hosts.ucx_across_hosts():
                results.append(_across_hosts(name, args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_transfer.json").write_text(json.dumps(results, indent=2))
    print(to_markdown(results))


if __name__ == "__main__":
    main()
