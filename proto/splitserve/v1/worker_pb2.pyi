from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole

class WorkerSamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos", "logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty", "constraint", "prompt_logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    constraint: OutputConstraint
    prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., constraint: _Optional[_Union[OutputConstraint, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class OutputConstraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: ChoiceList
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class KVPeerInfo(_message.Message):
    __slots__ = ("engine_id", "backend", "address", "metadata", "compat_hash", "version", "kv_layout")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    backend: str
    address: str
    metadata: bytes
    compat_hash: str
    version: int
    kv_layout: str
    def __init__(self, engine_id: _Optional[str] = ..., backend: _Optional[str] = ..., address: _Optional[str] = ..., metadata: _Optional[bytes] = ..., compat_hash: _Optional[str] = ..., version: _Optional[int] = ..., kv_layout: _Optional[str] = ...) -> None: ...

class KVRef(_message.Message):
    __slots__ = ("engine_id", "req_id", "block_ids", "num_tokens", "grant")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    req_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    grant: bytes
    def __init__(self, engine_id: _Optional[str] = ..., req_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., grant: _Optional[bytes] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "priority", "lora_name", "peer_kv_ref", "peer_kv_peer", "kv_lease_ttl_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    PEER_KV_REF_FIELD_NUMBER: _ClassVar[int]
    PEER_KV_PEER_FIELD_NUMBER: _ClassVar[int]
    KV_LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: WorkerSamplingParams
    cache_salt: str
    priority: int
    lora_name: str
    peer_kv_ref: KVRef
    peer_kv_peer: KVPeerInfo
    kv_lease_ttl_s: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[WorkerSamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., lora_name: _Optional[str] = ..., peer_kv_ref: _Optional[_Union[KVRef, _Mapping]] = ..., peer_kv_peer: _Optional[_Union[KVPeerInfo, _Mapping]] = ..., kv_lease_ttl_s: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("token_id", "logprob", "finished", "finish_reason", "num_cached_tokens", "kv_ref", "kv_peer", "prefill_time_s", "stop_reason", "prompt_logprobs", "num_peer_blocks", "peer_pull_failed", "num_tier_tokens")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_REF_FIELD_NUMBER: _ClassVar[int]
    KV_PEER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_PEER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEER_PULL_FAILED_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: TokenLogprob
    finished: bool
    finish_reason: str
    num_cached_tokens: int
    kv_ref: KVRef
    kv_peer: KVPeerInfo
    prefill_time_s: float
    stop_reason: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    num_peer_blocks: int
    peer_pull_failed: bool
    num_tier_tokens: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., kv_ref: _Optional[_Union[KVRef, _Mapping]] = ..., kv_peer: _Optional[_Union[KVPeerInfo, _Mapping]] = ..., prefill_time_s: _Optional[float] = ..., stop_reason: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., num_peer_blocks: _Optional[int] = ..., peer_pull_failed: _Optional[bool] = ..., num_tier_tokens: _Optional[int] = ...) -> None: ...

class PinPrefixRequest(_message.Message):
    __slots__ = ("pin_id", "prompt_token_ids", "max_blocks", "cache_salt", "lora_name", "ttl_s")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_blocks: int
    cache_salt: str
    lora_name: str
    ttl_s: float
    def __init__(self, pin_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_blocks: _Optional[int] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PinPrefixResponse(_message.Message):
    __slots__ = ("kv_ref", "kv_peer")
    KV_REF_FIELD_NUMBER: _ClassVar[int]
    KV_PEER_FIELD_NUMBER: _ClassVar[int]
    kv_ref: KVRef
    kv_peer: KVPeerInfo
    def __init__(self, kv_ref: _Optional[_Union[KVRef, _Mapping]] = ..., kv_peer: _Optional[_Union[KVPeerInfo, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling", "kv_ref", "kv_peer", "cache_salt", "priority", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_REF_FIELD_NUMBER: _ClassVar[int]
    KV_PEER_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: WorkerSamplingParams
    kv_ref: KVRef
    kv_peer: KVPeerInfo
    cache_salt: str
    priority: int
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[WorkerSamplingParams, _Mapping]] = ..., kv_ref: _Optional[_Union[KVRef, _Mapping]] = ..., kv_peer: _Optional[_Union[KVPeerInfo, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., lora_name: _Optional[str] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finished", "finish_reason", "stop_reason", "num_cached_tokens", "num_transferred_blocks", "kv_transfer_failed", "prompt_logprobs", "num_tier_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERRED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FAILED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finished: bool
    finish_reason: str
    stop_reason: str
    num_cached_tokens: int
    num_transferred_blocks: int
    kv_transfer_failed: bool
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    num_tier_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., num_transferred_blocks: _Optional[int] = ..., kv_transfer_failed: _Optional[bool] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., num_tier_tokens: _Optional[int] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "model", "vocab_size", "max_model_len", "block_size", "kv_peer", "kv_transfer_backend", "dtype", "cpu_isa", "kernels", "served_model_name", "revision", "scheduling_policy")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_PEER_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CPU_ISA_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SCHEDULING_POLICY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    model: str
    vocab_size: int
    max_model_len: int
    block_size: int
    kv_peer: KVPeerInfo
    kv_transfer_backend: str
    dtype: str
    cpu_isa: str
    kernels: str
    served_model_name: str
    revision: str
    scheduling_policy: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_peer: _Optional[_Union[KVPeerInfo, _Mapping]] = ..., kv_transfer_backend: _Optional[str] = ..., dtype: _Optional[str] = ..., cpu_isa: _Optional[str] = ..., kernels: _Optional[str] = ..., served_model_name: _Optional[str] = ..., revision: _Optional[str] = ..., scheduling_policy: _Optional[str] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_waiting_for_kv", "num_kv_leases", "num_total_blocks", "num_used_blocks", "num_cached_blocks", "kv_usage", "num_queued_prefill_tokens", "num_preemptions", "num_transfers_failed", "num_leases_expired", "shutting_down", "num_draft_tokens", "num_accepted_draft_tokens", "lora_adapters", "num_tier_blocks", "num_tier_stored_blocks", "num_tier_hit_blocks", "num_tier_refused_blocks", "tier_load_s_per_block", "prefill_s_per_token")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FOR_KV_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERS_FAILED_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    SHUTTING_DOWN_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_REFUSED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_LOAD_S_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    num_kv_leases: int
    num_total_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    kv_usage: float
    num_queued_prefill_tokens: int
    num_preemptions: int
    num_transfers_failed: int
    num_leases_expired: int
    shutting_down: bool
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapterInfo]
    num_tier_blocks: int
    num_tier_stored_blocks: int
    num_tier_hit_blocks: int
    num_tier_refused_blocks: int
    tier_load_s_per_block: float
    prefill_s_per_token: float
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_waiting_for_kv: _Optional[int] = ..., num_kv_leases: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., kv_usage: _Optional[float] = ..., num_queued_prefill_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_transfers_failed: _Optional[int] = ..., num_leases_expired: _Optional[int] = ..., shutting_down: _Optional[bool] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_draft_tokens: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[_Union[LoraAdapterInfo, _Mapping]]] = ..., num_tier_blocks: _Optional[int] = ..., num_tier_stored_blocks: _Optional[int] = ..., num_tier_hit_blocks: _Optional[int] = ..., num_tier_refused_blocks: _Optional[int] = ..., tier_load_s_per_block: _Optional[float] = ..., prefill_s_per_token: _Optional[float] = ...) -> None: ...

class LoraAdapterInfo(_message.Message):
    __slots__ = ("name", "block_key")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEY_FIELD_NUMBER: _ClassVar[int]
    name: str
    block_key: str
    def __init__(self, name: _Optional[str] = ..., block_key: _Optional[str] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path", "base_model_name")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    base_model_name: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., base_model_name: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class LoraAdapterResponse(_message.Message):
    __slots__ = ("lora_adapters",)
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapterInfo]
    def __init__(self, lora_adapters: _Optional[_Iterable[_Union[LoraAdapterInfo, _Mapping]]] = ...) -> None: ...
