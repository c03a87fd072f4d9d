"""Engine configuration: every field is a CLI flag with an env var (see ``engine.flags``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.constraint import ConstraintLimits
from engine.cpu_isa import ISA_CHOICES, resolve_isa
from engine.cpu_tuning import parse_cpu_list
from engine.flags import flag
from engine.lora.names import parse_lora_modules

# "auto": bfloat16 where the host has native bf16 dot products (CUDA, AVX512_BF16 CPUs),
# float32 on CPUs below (bf16 matmuls are emulated there, ~4.6x slower; BENCHMARKS.md).
DTYPES = ("auto", "float32", "bfloat16", "float16")
KERNEL_BACKENDS = ("auto", "torch", "cpp", "triton")
LOAD_FORMATS = ("auto", "dummy")
# vLLM's names; "fp8" is its alias of fp8_e4m3. The 8-bit ones are engine/model/kv_quant.py's.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "int8")


class EngineKind(enum.StrEnum):
    """Which engine a worker runs (``--engine``): a ``str``, as ``Role`` is."""

    NATIVE = "native"  # this repository's model code
    MOCK = "mock"  # simulated: no model math (engine/simulated.py)
    VLLM = "vllm"  # vLLM's engine core, in-process (engine/vllm_engine/)


ENGINES = tuple(kind.value for kind in EngineKind)


class SchedulingPolicy(enum.StrEnum):
    """How the scheduler orders waiting requests (vLLM's ``--scheduling-policy``)."""

    FCFS = "fcfs"  # arrival order
    PRIORITY = "priority"  # by each request's priority (lower first), then arrival


SCHEDULING_POLICIES = tuple(policy.value for policy in SchedulingPolicy)
# --engine mock's step profile: the native engine's, fitted on SmolLM2-135M (float32) on an
# AVX2 host (BENCHMARKS.md, "The simulated engine's profile").
MOCK_STEP_MS = 70.5
MOCK_PREFILL_US_PER_TOKEN = 2162.0
MOCK_DECODE_US_PER_SEQ = 2360.0
MOCK_KV_READ_US_PER_BLOCK = 81.4
_MOCK_PROFILE_FIELDS = (
    "mock_step_ms",
    "mock_prefill_us_per_token",
    "mock_decode_us_per_seq",
    "mock_kv_read_us_per_block",
)
# Draft tokens per greedy decode step (BENCHMARKS.md, "Speculative decoding").
DEFAULT_NUM_SPECULATIVE_TOKENS = 3


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How one engine instance runs a model. Immutable once the engine starts."""

    model: str = flag(
        help="model directory, .gguf file, alias (e.g. smollm2-135m) or Hugging Face repo id "
        "(org/name, downloaded into the Hugging Face cache; HF_TOKEN for gated models)"
    )
    engine: EngineKind = flag(
        EngineKind.NATIVE,
        "native: this repository's model code; vllm: vLLM's engine (every model family vLLM "
        "runs, on its GPU and CPU platforms; needs the vllm extra, with --vllm-args for vLLM's "
        "own engine options); mock: a simulated engine that runs no model math (the native "
        "scheduler and KV block pool, steps that take the --mock-* profile's time, token ids "
        "that depend on the prompt alone, deterministic KV bytes): for testing routing, "
        "scaling and KV transfer with many workers on one machine",
        choices=ENGINES,
    )
    vllm_args: str = flag(
        "",
        "--engine vllm: vLLM engine arguments, as on vllm serve's command line, e.g. "
        "'--tensor-parallel-size 4 --quantization awq --gpu-memory-utilization 0.85'; they "
        "override what splitserve's own flags set",
    )
    revision: str | None = flag(
        None, "branch, tag or commit of a Hugging Face repo id --model (default: main)"
    )
    served_model_name: str | None = flag(
        None, "the model name clients see (Router.Status, the HTTP API); default: --model"
    )
    dtype: str = flag(
        "auto",
        "weights and activations dtype; auto: bfloat16 on CUDA and on CPUs with AVX-512 BF16, "
        "float32 on other CPUs",
        choices=DTYPES,
    )
    kv_cache_dtype: str = flag(
        "auto",
        "KV cache dtype: 8 bits per value with a float32 scale per token and head (int8, "
        "fp8_e4m3; fp8 is fp8_e4m3: about half the bytes per token to read, transfer and cache) "
        "or the model's dtype (float32/bfloat16/float16, must equal --dtype); auto: int8 for a "
        "bfloat16 model on CPU, else the model's dtype",
        choices=KV_CACHE_DTYPES,
    )
    device: str = flag("auto", "cpu, cuda, cuda:N or auto (cuda when available)")
    block_size: int = flag(16, "tokens per KV block")
    max_num_seqs: int = flag(128, "max requests in the running batch")
    scheduling_policy: SchedulingPolicy = flag(
        SchedulingPolicy.FCFS,
        "fcfs: requests run in arrival order; priority: by each request's priority (lower "
        "first; the router gives a request its tenant's), then arrival, and a waiting request "
        "that finds no room preempts a running one of lower priority (as vLLM's)",
        choices=SCHEDULING_POLICIES,
    )
    max_num_batched_tokens: int = flag(2048, "max tokens computed per step (prefill chunk size)")
    long_prefill_token_threshold: int = flag(
        0,
        "most prompt tokens one request computes per step, so that other prompts and decodes "
        "share the step with a long one (0: up to the whole step budget)",
    )
    max_model_len: int | None = flag(None, "max prompt + output tokens (default: model's)")
    kv_cache_memory_gb: float | None = flag(
        None, "KV cache size in GiB (default: 2 on CPU, 80%% of free memory on CUDA)"
    )
    num_kv_blocks: int | None = flag(None, "exact number of KV blocks (overrides the size)")
    enable_prefix_caching: bool = flag(True, "reuse KV blocks of shared prompt prefixes")
    kv_offload_gib: float = flag(
        0.0,
        "a second KV tier of this many GiB under the prefix cache (--engine native or mock): "
        "blocks the cache evicts go there and come back on a prefix hit instead of being "
        "recomputed; on local disk with --kv-offload-dir, else in host memory (for a GPU "
        "engine); 0: none",
    )
    kv_offload_dir: str | None = flag(
        None,
        "--kv-offload-gib: keep the tier's blocks in files under this directory (one per worker; "
        "they survive a restart of the worker and are checked on every read)",
    )
    check_kv_integrity: bool = flag(
        False, "check the KV block pool's invariants after every step (slow: tests, debugging)"
    )
    seed: int = flag(0, "seed of the shared sampling generator")
    num_threads: int | None = flag(
        None, "torch CPU threads (default: one per --cpu-cores core, else all cores)"
    )
    cpu_cores: str | None = flag(
        None, "pin the process to these CPU cores, e.g. '1' or '0-3' (default: no pinning)"
    )
    # Not a flag: workers turn it off because the router owns text and stop strings.
    detokenize: bool = True
    # Not a flag: the router applies the same budget (one for the cluster; tests lower it).
    constraint_limits: ConstraintLimits = field(default_factory=ConstraintLimits)
    kernel_backend: str = flag(
        "auto",
        "attention and CPU kernels: cpp (compiled paged decode, oneDNN-packed linears; in "
        "bfloat16 also fused RMSNorm/rotary/SiLU and, from avx512_bf16, the paged prefill), "
        "triton (paged decode, prefill and KV write kernels: GPUs; on CPU only under "
        "TRITON_INTERPRET=1), torch (reference paths: F.linear, SDPA prefill, torch decode and "
        "ops), auto (triton on a GPU when installed; cpp on CPU when it builds; else torch)",
        choices=KERNEL_BACKENDS,
    )
    load_format: str = flag(
        "auto",
        "auto: the weights from the model's safetensors files; dummy: random weights from its "
        "config.json alone (benchmarks of shapes whose weights are not at hand)",
        choices=LOAD_FORMATS,
    )
    enforce_eager: bool = flag(
        False,
        "run every step eagerly: capture no CUDA graphs of decode steps (with the triton "
        "kernels on a GPU, graphs are captured at start-up for batches of up to 512 decode rows)",
    )
    num_speculative_tokens: int = flag(
        DEFAULT_NUM_SPECULATIVE_TOKENS,
        "draft tokens per greedy decode step, found by prompt lookup (vLLM's ngram method): "
        "the target model scores them with the step's token and keeps those that match its own "
        "argmax, so outputs are unchanged; 0 turns speculation off",
    )
    prompt_lookup_max: int = flag(4, "longest suffix n-gram the prompt lookup matches")
    prompt_lookup_min: int = flag(
        2,
        "shortest suffix n-gram the prompt lookup matches (1 drafts after any repeated token: "
        "more drafts, fewer accepted)",
    )
    enable_lora: bool = flag(
        False,
        "serve LoRA adapters (PEFT's format): --lora-modules at start, more at run time; a "
        "request names its adapter as its model",
    )
    lora_modules: str = flag(
        "",
        "--enable-lora: adapters to load at start, as name=path pairs separated by commas (paths "
        "as the workers see them)",
    )
    max_loras: int = flag(
        4,
        "--enable-lora: most adapters loaded at once; every loaded one can run in any step, so "
        "this is also the most adapters in a batch",
    )
    max_lora_rank: int = flag(16, "--enable-lora: highest adapter rank served")
    cpu_isa: str = flag(
        "auto",
        "CPU instruction-set level the kernels may use: auto (the host's), or a lower one to "
        "reproduce a smaller host (avx2, portable, ...); see engine/cpu_isa.py",
        choices=ISA_CHOICES,
    )

    mock_step_ms: float = flag(MOCK_STEP_MS, "--engine mock: the fixed cost of a step (ms)")
    mock_prefill_us_per_token: float = flag(
        MOCK_PREFILL_US_PER_TOKEN, "--engine mock: a step's cost per prompt token computed (us)"
    )
    mock_decode_us_per_seq: float = flag(
        MOCK_DECODE_US_PER_SEQ, "--engine mock: a step's cost per sequence decoded (us)"
    )
    mock_kv_read_us_per_block: float = flag(
        MOCK_KV_READ_US_PER_BLOCK, "--engine mock: a step's cost per KV block attention reads (us)"
    )

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        # Given as its name (a test, a caller's literal): the member, so that `is` holds.
        object.__setattr__(self, "engine", EngineKind(self.engine))
        object.__setattr__(self, "scheduling_policy", SchedulingPolicy(self.scheduling_policy))
        for name in _MOCK_PROFILE_FIELDS:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        threshold = self.long_prefill_token_threshold
        if threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {threshold}")
        if self.num_speculative_tokens < 0:
            raise ValueError(
                f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        resolve_isa(self.cpu_isa)
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lora_modules:
            if not self.enable_lora:
                raise ValueError("lora_modules needs enable_lora")
            if len(parse_lora_modules(self.lora_modules)) > self.max_loras:
                raise ValueError(f"lora_modules: more adapters than max_loras {self.max_loras}")
        if self.cpu_cores is not None:
            parse_cpu_list(self.cpu_cores)
        if self.kv_offload_gib < 0:
            raise ValueError(f"kv_offload_gib must be >= 0, got {self.kv_offload_gib}")
        if self.kv_offload_dir and not self.kv_offload_gib:
            raise ValueError("kv_offload_dir needs kv_offload_gib > 0")
        if self.kv_offload_gib and self.engine is EngineKind.VLLM:
            raise ValueError(
                "kv_offload_gib: the second KV tier is the native (and mock) engine's; vLLM's "
                "engine has none here"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
