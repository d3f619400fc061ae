from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_RANK_FAILED: _ClassVar[ErrorReason]
    ERROR_REASON_COLLECTIVE_TIMEOUT: _ClassVar[ErrorReason]
    ERROR_REASON_COLLECTIVE_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_AUTHENTICATION: _ClassVar[ErrorReason]
    ERROR_REASON_RENDEZVOUS: _ClassVar[ErrorReason]
    ERROR_REASON_ABORTED: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_ARGUMENT: _ClassVar[ErrorReason]
    ERROR_REASON_RESOURCE_EXHAUSTED: _ClassVar[ErrorReason]
    ERROR_REASON_NOT_FOUND: _ClassVar[ErrorReason]

class MemberState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_STATE_UNSPECIFIED: _ClassVar[MemberState]
    MEMBER_STATE_JOINING: _ClassVar[MemberState]
    MEMBER_STATE_ALIVE: _ClassVar[MemberState]
    MEMBER_STATE_LEFT: _ClassVar[MemberState]
    MEMBER_STATE_FAILED: _ClassVar[MemberState]
ERROR_REASON_UNSPECIFIED: ErrorReason
ERROR_REASON_RANK_FAILED: ErrorReason
ERROR_REASON_COLLECTIVE_TIMEOUT: ErrorReason
ERROR_REASON_COLLECTIVE_MISMATCH: ErrorReason
ERROR_REASON_AUTHENTICATION: ErrorReason
ERROR_REASON_RENDEZVOUS: ErrorReason
ERROR_REASON_ABORTED: ErrorReason
ERROR_REASON_INVALID_ARGUMENT: ErrorReason
ERROR_REASON_RESOURCE_EXHAUSTED: ErrorReason
ERROR_REASON_NOT_FOUND: ErrorReason
MEMBER_STATE_UNSPECIFIED: MemberState
MEMBER_STATE_JOINING: MemberState
MEMBER_STATE_ALIVE: MemberState
MEMBER_STATE_LEFT: MemberState
MEMBER_STATE_FAILED: MemberState

class DeviceIdentity(_message.Message):
    __slots__ = ("kind", "uuid", "pci_bus_id", "index")
    KIND_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    kind: str
    uuid: str
    pci_bus_id: str
    index: int
    def __init__(self, kind: _Optional[str] = ..., uuid: _Optional[str] = ..., pci_bus_id: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("rank", "host", "local_rank", "local_size", "node_rank", "peer_address", "device", "pid", "state", "seconds_since_heartbeat")
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    host: str
    local_rank: int
    local_size: int
    node_rank: int
    peer_address: str
    device: DeviceIdentity
    pid: int
    state: MemberState
    seconds_since_heartbeat: float
    def __init__(self, rank: _Optional[int] = ..., host: _Optional[str] = ..., local_rank: _Optional[int] = ..., local_size: _Optional[int] = ..., node_rank: _Optional[int] = ..., peer_address: _Optional[str] = ..., device: _Optional[_Union[DeviceIdentity, _Mapping]] = ..., pid: _Optional[int] = ..., state: _Optional[_Union[MemberState, str]] = ..., seconds_since_heartbeat: _Optional[float] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("group", "started_seq", "finished_seq", "last_op")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    STARTED_SEQ_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_OP_FIELD_NUMBER: _ClassVar[int]
    group: str
    started_seq: int
    finished_seq: int
    last_op: str
    def __init__(self, group: _Optional[str] = ..., started_seq: _Optional[int] = ..., finished_seq: _Optional[int] = ..., last_op: _Optional[str] = ...) -> None: ...

class CollectiveStats(_message.Message):
    __slots__ = ("op", "group", "count", "bytes", "seconds", "bucket_counts", "bus_bytes", "failed")
    OP_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_COUNTS_FIELD_NUMBER: _ClassVar[int]
    BUS_BYTES_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    op: str
    group: str
    count: int
    bytes: int
    seconds: float
    bucket_counts: _containers.RepeatedScalarFieldContainer[int]
    bus_bytes: float
    failed: int
    def __init__(self, op: _Optional[str] = ..., group: _Optional[str] = ..., count: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., bucket_counts: _Optional[_Iterable[int]] = ..., bus_bytes: _Optional[float] = ..., failed: _Optional[int] = ...) -> None: ...
