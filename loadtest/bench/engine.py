"""Offline engine benchmark: splitserve vs transformers vs vLLM on one fixed workload.

``python -m loadtest.bench.engine --model DIR_OR_ALIAS [--systems splitserve,transformers,vllm]``
runs each system in its own fresh child process (``loadtest.bench.arm_<system>``) on the
same model directory and the same prompt token ids (see ``loadtest.generator.workloads``), then
prints a Markdown table and writes ``results.json`` + ``report.md`` under ``--out``. Peak RSS
is sampled by the parent over each child's whole process tree (vLLM runs an EngineCore
subprocess) and also read from ``wait4`` (largest single process). ``--make-tiny-model DIR``
writes a tiny random Llama instead of benchmarking.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from engine.config import DEFAULT_NUM_SPECULATIVE_TOKENS
from engine.cpu_isa import ISA_CHOICES, cpu_auto_dtype, host_isa, library_env, resolve_isa
from loadtest.bench.arm_protocol import ArmJob, ArmResult
from loadtest.bench.report import ArmRun, all_pair_matches, markdown_report, system_metrics
from loadtest.fixtures.tiny_model import SHAPES, make_tiny_model
from loadtest.generator.workloads import Workload, add_workload_flags, workload_from_args

REPO_ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = ("splitserve", "transformers", "vllm")
_RSS_SAMPLE_PERIOD_S = 0.2
_LOG_TAIL_CHARS = 1500


def resolve_model_dir(name_or_path: str) -> Path:
    """Resolve an alias via ``engine.loader.models`` when available, else treat as a path."""
    try:
        from engine.loader.models import resolve_model
    except ImportError:
        return Path(name_or_path).resolve()
    return Path(resolve_model(name_or_path)).resolve()


class TreeSampler:
    """Samples a process tree: peak summed RSS, and CPU seconds per pid (last value seen).

    CPU is accumulated per pid rather than read from ``wait4`` because vLLM's EngineCore and
    worker processes are not always reaped by the arm, so their rusage can be lost.
    """

    __slots__ = ("_cpu_s_by_pid", "_root", "peak_rss_bytes")

    def __init__(self, pid: int) -> None:
        self._root = psutil.Process(pid)
        self._cpu_s_by_pid: dict[int, float] = {}
        self.peak_rss_bytes = 0

    def sample(self) -> None:
        try:
            members = [self._root, *self._root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        rss = 0
        for member in members:
            try:
                with member.oneshot():
                    rss += member.memory_info().rss
                    times = member.cpu_times()
            except psutil.NoSuchProcess:
                continue
            self._cpu_s_by_pid[member.pid] = times.user + times.system
        self.peak_rss_bytes = max(self.peak_rss_bytes, rss)

    def cpu_s(self) -> float:
        return sum(self._cpu_s_by_pid.values())


def _terminate_group(pgid: int) -> None:
    """Stop what is left of a child's process group (vLLM workers can outlive their parent)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        time.sleep(1.0)


@dataclass(frozen=True, slots=True)
class ChildStats:
    """What the parent saw of one child process (rusage covers its reaped descendants)."""

    exit_code: int
    wall_s: float
    cpu_s: float
    peak_tree_rss_mib: float
    maxrss_mib: float


def run_child(cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> ChildStats:
    """Run ``cmd`` in a new session, sampling its tree RSS until it exits.

    On timeout the whole process group is killed. Side effect: child stdout+stderr go to
    ``log_path``.
    """
    start_s = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    sampler = TreeSampler(proc.pid)
    while True:
        # wait4 (not Popen.wait) so the child's own rusage comes back with its exit status.
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        sampler.sample()
        if time.perf_counter() - start_s > timeout_s:
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(_RSS_SAMPLE_PERIOD_S)
    wall_s = time.perf_counter() - start_s
    proc.returncode = os.waitstatus_to_exitcode(status)
    _terminate_group(proc.pid)
    return ChildStats(
        exit_code=proc.returncode,
        wall_s=wall_s,
        cpu_s=max(sampler.cpu_s(), usage.ru_utime + usage.ru_stime),
        peak_tree_rss_mib=sampler.peak_rss_bytes / 2**20,
        maxrss_mib=usage.ru_maxrss / 1024.0,
    )


def vllm_ld_preload(setting: str, vllm_python: str) -> str:
    """``LD_PRELOAD`` for the vLLM arm: ``auto`` = tcmalloc + the venv's libiomp5 if present.

    vLLM's CPU backend asks for both (its workers warn without them).
    """
    if setting != "auto":
        return setting
    candidates = [
        Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
        Path(vllm_python).parent.parent / "lib" / "libiomp5.so",
    ]
    return ":".join(str(c) for c in candidates if c.exists())


def child_env(system: str, args: argparse.Namespace) -> dict[str, str]:
    """Environment of one arm; vLLM CPU settings are made explicit so they can be reported."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.update(
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS=str(args.threads),
    )
    if args.cpu_isa != "auto":
        env.update(library_env(resolve_isa(args.cpu_isa)))
    if system == "vllm":
        cpus = sorted(os.sched_getaffinity(0))[: args.threads]
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_kv_cache_gib)
        # "auto" reserves a core for the scheduler process; on 2 cores that halves compute.
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cpus)
        preload = vllm_ld_preload(args.vllm_ld_preload, args.vllm_python)
        if preload:
            env["LD_PRELOAD"] = preload
    return env


def run_arm(system: str, job: ArmJob, args: argparse.Namespace, out_dir: Path) -> ArmRun:
    """Run one system's child and collect its result, or the reason it failed."""
    job_path, result_path = out_dir / f"{system}.job.json", out_dir / f"{system}.result.json"
    log_path = out_dir / f"{system}.log"
    job.write(job_path)
    result_path.unlink(missing_ok=True)
    python = args.vllm_python if system == "vllm" else sys.executable
    if not Path(python).exists():
        error = f"interpreter {python} not found"
        print(f"[bench_engine] {system}: {error}", file=sys.stderr)
        return ArmRun(
            system=system,
            result=None,
            error=error,
            process_wall_s=0.0,
            process_cpu_s=0.0,
            peak_tree_rss_mib=0.0,
            wait4_maxrss_mib=0.0,
            host_load_1m=(0.0, 0.0),
        )
    cmd = [python, "-m", f"loadtest.bench.arm_{system}", str(job_path), str(result_path)]
    print(f"[bench_engine] {system}: running (log {log_path})", file=sys.stderr, flush=True)
    load_start = os.getloadavg()[0]
    stats = run_child(cmd, child_env(system, args), log_path, args.arm_timeout_s)
    host_load_1m = (load_start, os.getloadavg()[0])
    if stats.exit_code == 0 and result_path.exists():
        result, error = ArmResult.read(result_path), None
    else:
        result = None
        tail = log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        last_line = next((ln for ln in reversed(tail.splitlines()) if ln.strip()), "")
        error = f"exit {stats.exit_code}: {last_line}".replace("|", "/")
        print(f"[bench_engine] {system} failed ({error}); log tail:\n{tail}", file=sys.stderr)
    print(f"[bench_engine] {system}: done in {stats.wall_s:.1f} s", file=sys.stderr, flush=True)
    return ArmRun(
        system=system,
        result=result,
        error=error,
        process_wall_s=stats.wall_s,
        process_cpu_s=stats.cpu_s,
        peak_tree_rss_mib=stats.peak_tree_rss_mib,
        wait4_maxrss_mib=stats.maxrss_mib,
        host_load_1m=host_load_1m,
    )


def _header(args: argparse.Namespace, model_dir: Path, workload: Workload) -> list[str]:
    return [
        f"## bench_engine: {args.model} ({args.dtype})",
        "",
        f"- device {args.device}; CPU level {resolve_isa(args.cpu_isa).value} (host "
        f"{host_isa().value}, --cpu-isa {args.cpu_isa}); --dtype {args.dtype_requested} runs "
        f"{args.dtype} in every system; --kv-cache-dtype {args.kv_cache_dtype} (splitserve, vLLM)",
        "- speculation (prompt lookup): "
        + (
            "each system's default (splitserve: "
            f"{DEFAULT_NUM_SPECULATIVE_TOKENS} draft tokens, "
            "vLLM: none)"
            if args.num_speculative_tokens is None
            else f"{args.num_speculative_tokens} draft tokens in splitserve and vLLM"
        ),
        f"- model dir: `{model_dir}`",
        f"- workload: {workload.num_prompts} prompts ({workload.method}, seed {workload.seed}), "
        f"prompt tokens uniform in [{args.min_prompt_tokens}, {args.max_prompt_tokens}] "
        f"(total {workload.total_prompt_tokens}), {workload.output_tokens} output tokens each, "
        "greedy, ignore_eos",
        f"- threads {args.threads}, max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
        f"{args.max_num_batched_tokens}, transformers static batch {args.hf_batch_size}, "
        f"vLLM enforce_eager, VLLM_CPU_KVCACHE_SPACE={args.vllm_kv_cache_gib}",
        f"- vLLM LD_PRELOAD: `{vllm_ld_preload(args.vllm_ld_preload, args.vllm_python) or '-'}`",
        "- TTFT from the common start of the run (all requests submitted at once); "
        "transformers TTFT = its batch's first token",
        "- output tok/CPU-s = generated tokens / CPU seconds of the arm's process tree during "
        "generation; prefer it over tok/s when the host load (last column) is above the "
        "thread count",
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.engine", description=__doc__)
    p.add_argument("--model", help="HF-format model dir or a splitserve model alias")
    p.add_argument(
        "--make-tiny-model",
        type=Path,
        metavar="DIR",
        help="write a random-weight Llama + tokenizer of --shape to DIR and exit",
    )
    p.add_argument(
        "--shape",
        choices=tuple(SHAPES),
        default="bench",
        help="--make-tiny-model's shape: bench (hidden 256, 4 layers), smollm2-135m "
        "(SmolLM2-135M's shape, random weights: for machines the real weights cannot reach) or "
        "llama3-8b (Llama-3-8B's shape: config and tokenizer only, run with --load-format dummy)",
    )
    p.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        default="auto",
        help="splitserve's --load-format (dummy: random weights from config.json alone; the "
        "other systems need the weights, so run splitserve alone)",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="auto: splitserve's choice for the CPU level (bfloat16 from avx512_bf16, else "
        "float32), given to every system",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "bfloat16", "float32", "fp8", "fp8_e4m3", "int8"),
        default="auto",
        help="splitserve's and vLLM's --kv-cache-dtype (auto: each system's default; vLLM CPU "
        "has fp8 but no int8; bfloat16/float32 must be --dtype)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where splitserve and transformers run (vLLM's arm is vLLM CPU: leave it out on "
        "cuda); on cuda --dtype auto is bfloat16",
    )
    p.add_argument(
        "--cpu-isa",
        choices=ISA_CHOICES,
        default="auto",
        help="run every system at this CPU level: splitserve's --cpu-isa plus torch's and "
        "oneDNN's env caps (vLLM's own compiled kernels pick theirs from the real CPU)",
    )
    add_workload_flags(p)
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="comma-separated subset of " + ",".join(SYSTEMS),
    )
    p.add_argument("--vllm-python", default="/opt/vllm-venv/bin/python")
    p.add_argument(
        "--vllm-kv-cache-gib",
        type=int,
        default=2,
        help="VLLM_CPU_KVCACHE_SPACE for the vLLM arm; vLLM allocates it up front, so it counts "
        "in its RSS (2 = splitserve's CPU default KV budget)",
    )
    p.add_argument(
        "--vllm-ld-preload",
        default="auto",
        help="LD_PRELOAD for the vLLM arm ('auto': tcmalloc + venv libiomp5 if found; '' = none)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        help="prompt-lookup (ngram) draft tokens per step in splitserve and vLLM alike (0: "
        "none); default: each system's own (splitserve drafts, vLLM does not)",
    )
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--arm-timeout-s", type=float, default=1800.0)
    p.add_argument("--out", type=Path, default=Path("bench-out/engine"))
    args = p.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        p.error(f"unknown systems: {', '.join(unknown)}")
    args.systems = systems
    args.dtype_requested = args.dtype
    if args.device == "cuda" and "vllm" in systems:
        p.error("the vllm arm runs vLLM CPU: leave it out of --systems with --device cuda")
    if args.dtype == "auto":
        args.dtype = (
            "bfloat16" if args.device == "cuda" else cpu_auto_dtype(resolve_isa(args.cpu_isa))
        )
    if args.make_tiny_model is None and not args.model:
        p.error("--model is required (or --make-tiny-model DIR)")
    if args.load_format == "dummy" and args.systems != ["splitserve"]:
        p.error("--load-format dummy runs splitserve alone (--systems splitserve)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.make_tiny_model is not None:
        print(make_tiny_model(args.make_tiny_model, "llama", args.seed, SHAPES[args.shape]))
        return 0
    model_dir = resolve_model_dir(args.model)
    workload = workload_from_args(model_dir, args)
    out_dir = args.out.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: list[ArmRun] = []
    for system in args.systems:
        job = ArmJob(
            system=system,
            model_dir=str(model_dir),
            dtype=args.dtype,
            prompt_token_ids=[list(p) for p in workload.prompt_token_ids],
            output_tokens=workload.output_tokens,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=workload.max_prompt_tokens + workload.output_tokens,
            hf_batch_size=args.hf_batch_size,
            threads=args.threads,
            seed=args.seed,
            cpu_isa=args.cpu_isa,
            device=args.device,
            kv_cache_dtype=args.kv_cache_dtype,
            num_speculative_tokens=args.num_speculative_tokens,
            load_format=args.load_format,
        )
        runs.append(run_arm(system, job, args, out_dir))

    report = markdown_report(_header(args, model_dir, workload), runs)
    print(report)
    (out_dir / "report.md").write_text(report)
    results = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model_dir": str(model_dir),
        "workload": {
            "method": workload.method,
            "seed": workload.seed,
            "prompt_lengths": [len(p) for p in workload.prompt_token_ids],
            "output_tokens": workload.output_tokens,
        },
        "systems": [
            {
                "system": r.system,
                "error": r.error,
                "metrics": asdict(system_metrics(r)) if r.result is not None else None,
                "result": asdict(r.result) if r.result is not None else None,
            }
            for r in runs
        ],
        "pair_matches": [asdict(m) for m in all_pair_matches(runs)],
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r.result is not None for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
