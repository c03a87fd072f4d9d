from splitserve.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolChoiceMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_CHOICE_MODE_UNSPECIFIED: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_AUTO: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_NONE: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_REQUIRED: _ClassVar[ToolChoiceMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
TOOL_CHOICE_MODE_UNSPECIFIED: ToolChoiceMode
TOOL_CHOICE_MODE_AUTO: ToolChoiceMode
TOOL_CHOICE_MODE_NONE: ToolChoiceMode
TOOL_CHOICE_MODE_REQUIRED: ToolChoiceMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "function_name")
    MODE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    mode: ToolChoiceMode
    function_name: str
    def __init__(self, mode: _Optional[_Union[ToolChoiceMode, str]] = ..., function_name: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty", "constraint", "prompt_logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
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
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    constraint: _worker_pb2.OutputConstraint
    prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., constraint: _Optional[_Union[_worker_pb2.OutputConstraint, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "token_ids", "messages", "sampling", "cache_salt", "tools", "tool_choice", "parallel_tool_calls", "priority", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling: SamplingParams
    cache_salt: str
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    priority: int
    model: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ..., priority: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finish_reason", "usage", "stop_reason", "tool_calls", "prompt_logprobs", "prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_worker_pb2.TokenLogprob]
    finish_reason: FinishReason
    usage: Usage
    stop_reason: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_worker_pb2.TokenLogprob]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_worker_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stop_reason: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_worker_pb2.TokenLogprob, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "name", "arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    name: str
    arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("mode", "model", "workers", "num_inflight_requests", "prefix_hit_blocks_predicted", "prefix_hit_blocks_realized", "pools", "lora_adapters", "models")
    MODE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_BLOCKS_PREDICTED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_BLOCKS_REALIZED_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    model: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    num_inflight_requests: int
    prefix_hit_blocks_predicted: int
    prefix_hit_blocks_realized: int
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, mode: _Optional[str] = ..., model: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., num_inflight_requests: _Optional[int] = ..., prefix_hit_blocks_predicted: _Optional[int] = ..., prefix_hit_blocks_realized: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., models: _Optional[_Iterable[str]] = ...) -> None: ...

class LoraAdaptersResponse(_message.Message):
    __slots__ = ("lora_adapters",)
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lora_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("role", "desired_workers", "num_ready", "num_starting", "num_draining", "num_restarts", "last_error", "num_failed_starts", "model")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DESIRED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_READY_FIELD_NUMBER: _ClassVar[int]
    NUM_STARTING_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_STARTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    role: _worker_pb2.WorkerRole
    desired_workers: int
    num_ready: int
    num_starting: int
    num_draining: int
    num_restarts: int
    last_error: str
    num_failed_starts: int
    model: str
    def __init__(self, role: _Optional[_Union[_worker_pb2.WorkerRole, str]] = ..., desired_workers: _Optional[int] = ..., num_ready: _Optional[int] = ..., num_starting: _Optional[int] = ..., num_draining: _Optional[int] = ..., num_restarts: _Optional[int] = ..., last_error: _Optional[str] = ..., num_failed_starts: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("role", "num_workers", "model")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    role: _worker_pb2.WorkerRole
    num_workers: int
    model: str
    def __init__(self, role: _Optional[_Union[_worker_pb2.WorkerRole, str]] = ..., num_workers: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("address", "role", "healthy", "info", "load", "last_error", "draining")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: _worker_pb2.WorkerRole
    healthy: bool
    info: _worker_pb2.WorkerInfo
    load: _worker_pb2.WorkerLoad
    last_error: str
    draining: bool
    def __init__(self, address: _Optional[str] = ..., role: _Optional[_Union[_worker_pb2.WorkerRole, str]] = ..., healthy: _Optional[bool] = ..., info: _Optional[_Union[_worker_pb2.WorkerInfo, _Mapping]] = ..., load: _Optional[_Union[_worker_pb2.WorkerLoad, _Mapping]] = ..., last_error: _Optional[str] = ..., draining: _Optional[bool] = ...) -> None: ...

class PrefillCandidateScore(_message.Message):
    __slots__ = ("address", "worker_id", "matched_blocks", "queued_blocks", "cost", "reserved_blocks", "reserved_requests", "eligible", "tier_blocks")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ELIGIBLE_FIELD_NUMBER: _ClassVar[int]
    TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    address: str
    worker_id: str
    matched_blocks: int
    queued_blocks: float
    cost: float
    reserved_blocks: int
    reserved_requests: int
    eligible: bool
    tier_blocks: int
    def __init__(self, address: _Optional[str] = ..., worker_id: _Optional[str] = ..., matched_blocks: _Optional[int] = ..., queued_blocks: _Optional[float] = ..., cost: _Optional[float] = ..., reserved_blocks: _Optional[int] = ..., reserved_requests: _Optional[int] = ..., eligible: _Optional[bool] = ..., tier_blocks: _Optional[int] = ...) -> None: ...

class DecodeCandidateScore(_message.Message):
    __slots__ = ("address", "worker_id", "matched_blocks", "active_requests", "kv_usage", "cost", "tier_blocks")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    address: str
    worker_id: str
    matched_blocks: int
    active_requests: int
    kv_usage: float
    cost: float
    tier_blocks: int
    def __init__(self, address: _Optional[str] = ..., worker_id: _Optional[str] = ..., matched_blocks: _Optional[int] = ..., active_requests: _Optional[int] = ..., kv_usage: _Optional[float] = ..., cost: _Optional[float] = ..., tier_blocks: _Optional[int] = ...) -> None: ...

class ExplainResponse(_message.Message):
    __slots__ = ("prompt_tokens", "prompt_blocks", "prefill", "chosen_prefill", "decode", "chosen_decode", "prefill_place", "peer_pull_source", "peer_pull_blocks")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_DECODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PLACE_FIELD_NUMBER: _ClassVar[int]
    PEER_PULL_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PEER_PULL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    prompt_blocks: int
    prefill: _containers.RepeatedCompositeFieldContainer[PrefillCandidateScore]
    chosen_prefill: str
    decode: _containers.RepeatedCompositeFieldContainer[DecodeCandidateScore]
    chosen_decode: str
    prefill_place: str
    peer_pull_source: str
    peer_pull_blocks: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., prompt_blocks: _Optional[int] = ..., prefill: _Optional[_Iterable[_Union[PrefillCandidateScore, _Mapping]]] = ..., chosen_prefill: _Optional[str] = ..., decode: _Optional[_Iterable[_Union[DecodeCandidateScore, _Mapping]]] = ..., chosen_decode: _Optional[str] = ..., prefill_place: _Optional[str] = ..., peer_pull_source: _Optional[str] = ..., peer_pull_blocks: _Optional[int] = ...) -> None: ...
