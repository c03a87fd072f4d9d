from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVHello(_message.Message):
    __slots__ = ("version", "compat_hash", "engine_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    compat_hash: str
    engine_id: str
    def __init__(self, version: _Optional[int] = ..., compat_hash: _Optional[str] = ..., engine_id: _Optional[str] = ...) -> None: ...

class KVHelloAck(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class KVReadRequest(_message.Message):
    __slots__ = ("seq", "req_id", "block_ids", "run_lengths", "grant")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    RUN_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    req_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    run_lengths: _containers.RepeatedScalarFieldContainer[int]
    grant: bytes
    def __init__(self, seq: _Optional[int] = ..., req_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., run_lengths: _Optional[_Iterable[int]] = ..., grant: _Optional[bytes] = ...) -> None: ...

class KVReadResponse(_message.Message):
    __slots__ = ("seq", "ok", "error", "num_bytes")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    ok: bool
    error: str
    num_bytes: int
    def __init__(self, seq: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class KVReleaseRequest(_message.Message):
    __slots__ = ("req_id", "grant")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    grant: bytes
    def __init__(self, req_id: _Optional[str] = ..., grant: _Optional[bytes] = ...) -> None: ...

class KVReadEnd(_message.Message):
    __slots__ = ("seq", "req_id")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq: int
    req_id: str
    def __init__(self, seq: _Optional[int] = ..., req_id: _Optional[str] = ...) -> None: ...

class KVFrame(_message.Message):
    __slots__ = ("hello", "hello_ack", "read", "read_response", "release")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HELLO_ACK_FIELD_NUMBER: _ClassVar[int]
    READ_FIELD_NUMBER: _ClassVar[int]
    READ_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    hello: KVHello
    hello_ack: KVHelloAck
    read: KVReadRequest
    read_response: KVReadResponse
    release: KVReleaseRequest
    def __init__(self, hello: _Optional[_Union[KVHello, _Mapping]] = ..., hello_ack: _Optional[_Union[KVHelloAck, _Mapping]] = ..., read: _Optional[_Union[KVReadRequest, _Mapping]] = ..., read_response: _Optional[_Union[KVReadResponse, _Mapping]] = ..., release: _Optional[_Union[KVReleaseRequest, _Mapping]] = ...) -> None: ...

class NixlPeerMetadata(_message.Message):
    __slots__ = ("agent_metadata", "agent_name", "base_addr", "num_blocks", "block_bytes", "device_id", "mem_type")
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    agent_metadata: bytes
    agent_name: str
    base_addr: int
    num_blocks: int
    block_bytes: int
    device_id: int
    mem_type: str
    def __init__(self, agent_metadata: _Optional[bytes] = ..., agent_name: _Optional[str] = ..., base_addr: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., device_id: _Optional[int] = ..., mem_type: _Optional[str] = ...) -> None: ...

class NixlNotif(_message.Message):
    __slots__ = ("read_begin", "read_grant", "read_end", "release", "reader_metadata")
    READ_BEGIN_FIELD_NUMBER: _ClassVar[int]
    READ_GRANT_FIELD_NUMBER: _ClassVar[int]
    READ_END_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    READER_METADATA_FIELD_NUMBER: _ClassVar[int]
    read_begin: KVReadRequest
    read_grant: KVReadResponse
    read_end: KVReadEnd
    release: KVReleaseRequest
    reader_metadata: bytes
    def __init__(self, read_begin: _Optional[_Union[KVReadRequest, _Mapping]] = ..., read_grant: _Optional[_Union[KVReadResponse, _Mapping]] = ..., read_end: _Optional[_Union[KVReadEnd, _Mapping]] = ..., release: _Optional[_Union[KVReleaseRequest, _Mapping]] = ..., reader_metadata: _Optional[bytes] = ...) -> None: ...
