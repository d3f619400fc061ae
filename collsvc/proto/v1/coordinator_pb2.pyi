from collsvc.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_WATCHING: _ClassVar[EventKind]
    EVENT_KIND_MEMBER_FAILED: _ClassVar[EventKind]
    EVENT_KIND_MEMBER_LEFT: _ClassVar[EventKind]
    EVENT_KIND_JOB_ABORTED: _ClassVar[EventKind]
    EVENT_KIND_COLLECTIVE_MISMATCH: _ClassVar[EventKind]
    EVENT_KIND_PROGRESS_WANTED: _ClassVar[EventKind]
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_WATCHING: EventKind
EVENT_KIND_MEMBER_FAILED: EventKind
EVENT_KIND_MEMBER_LEFT: EventKind
EVENT_KIND_JOB_ABORTED: EventKind
EVENT_KIND_COLLECTIVE_MISMATCH: EventKind
EVENT_KIND_PROGRESS_WANTED: EventKind

class JoinRequest(_message.Message):
    __slots__ = ("job_id", "world_size", "requested_rank", "host", "peer_address", "device", "pid", "local_rank_hint", "timeout_s", "idempotency_key")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_HINT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    world_size: int
    requested_rank: int
    host: str
    peer_address: str
    device: _common_pb2.DeviceIdentity
    pid: int
    local_rank_hint: int
    timeout_s: float
    idempotency_key: str
    def __init__(self, job_id: _Optional[str] = ..., world_size: _Optional[int] = ..., requested_rank: _Optional[int] = ..., host: _Optional[str] = ..., peer_address: _Optional[str] = ..., device: _Optional[_Union[_common_pb2.DeviceIdentity, _Mapping]] = ..., pid: _Optional[int] = ..., local_rank_hint: _Optional[int] = ..., timeout_s: _Optional[float] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("rank", "world_size", "local_rank", "local_size", "node_rank", "num_nodes", "job_incarnation", "member_secret", "heartbeat_interval_s")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    JOB_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MEMBER_SECRET_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    node_rank: int
    num_nodes: int
    job_incarnation: int
    member_secret: str
    heartbeat_interval_s: float
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., local_rank: _Optional[int] = ..., local_size: _Optional[int] = ..., node_rank: _Optional[int] = ..., num_nodes: _Optional[int] = ..., job_incarnation: _Optional[int] = ..., member_secret: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class JoinBatchRequest(_message.Message):
    __slots__ = ("members",)
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[JoinRequest]
    def __init__(self, members: _Optional[_Iterable[_Union[JoinRequest, _Mapping]]] = ...) -> None: ...

class JoinBatchResponse(_message.Message):
    __slots__ = ("members",)
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[JoinResponse]
    def __init__(self, members: _Optional[_Iterable[_Union[JoinResponse, _Mapping]]] = ...) -> None: ...

class GetMembersRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetMembersResponse(_message.Message):
    __slots__ = ("members", "job_incarnation")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    JOB_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[_common_pb2.Member]
    job_incarnation: int
    def __init__(self, members: _Optional[_Iterable[_Union[_common_pb2.Member, _Mapping]]] = ..., job_incarnation: _Optional[int] = ...) -> None: ...

class BarrierRequest(_message.Message):
    __slots__ = ("job_id", "group", "rank", "generation", "timeout_s", "member_secret", "on_behalf_of")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MEMBER_SECRET_FIELD_NUMBER: _ClassVar[int]
    ON_BEHALF_OF_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group: str
    rank: int
    generation: int
    timeout_s: float
    member_secret: str
    on_behalf_of: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., group: _Optional[str] = ..., rank: _Optional[int] = ..., generation: _Optional[int] = ..., timeout_s: _Optional[float] = ..., member_secret: _Optional[str] = ..., on_behalf_of: _Optional[_Iterable[int]] = ...) -> None: ...

class WaitingMember(_message.Message):
    __slots__ = ("rank", "host", "last_op", "finished_seq")
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    LAST_OP_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_FIELD_NUMBER: _ClassVar[int]
    rank: int
    host: str
    last_op: str
    finished_seq: int
    def __init__(self, rank: _Optional[int] = ..., host: _Optional[str] = ..., last_op: _Optional[str] = ..., finished_seq: _Optional[int] = ...) -> None: ...

class BarrierResponse(_message.Message):
    __slots__ = ("complete", "waiting_on")
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    WAITING_ON_FIELD_NUMBER: _ClassVar[int]
    complete: bool
    waiting_on: _containers.RepeatedCompositeFieldContainer[WaitingMember]
    def __init__(self, complete: _Optional[bool] = ..., waiting_on: _Optional[_Iterable[_Union[WaitingMember, _Mapping]]] = ...) -> None: ...

class SetKeyRequest(_message.Message):
    __slots__ = ("job_id", "key", "value", "restore")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    key: str
    value: bytes
    restore: bool
    def __init__(self, job_id: _Optional[str] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ..., restore: _Optional[bool] = ...) -> None: ...

class SetKeyResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetKeyRequest(_message.Message):
    __slots__ = ("job_id", "key", "wait", "timeout_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    key: str
    wait: bool
    timeout_s: float
    def __init__(self, job_id: _Optional[str] = ..., key: _Optional[str] = ..., wait: _Optional[bool] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class GetKeyResponse(_message.Message):
    __slots__ = ("found", "value")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    found: bool
    value: bytes
    def __init__(self, found: _Optional[bool] = ..., value: _Optional[bytes] = ...) -> None: ...

class AddKeyRequest(_message.Message):
    __slots__ = ("job_id", "key", "amount")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    key: str
    amount: int
    def __init__(self, job_id: _Optional[str] = ..., key: _Optional[str] = ..., amount: _Optional[int] = ...) -> None: ...

class AddKeyResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class CompareSetKeyRequest(_message.Message):
    __slots__ = ("job_id", "key", "expect_absent", "expected", "desired")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECT_ABSENT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    key: str
    expect_absent: bool
    expected: bytes
    desired: bytes
    def __init__(self, job_id: _Optional[str] = ..., key: _Optional[str] = ..., expect_absent: _Optional[bool] = ..., expected: _Optional[bytes] = ..., desired: _Optional[bytes] = ...) -> None: ...

class CompareSetKeyResponse(_message.Message):
    __slots__ = ("swapped", "value")
    SWAPPED_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    swapped: bool
    value: bytes
    def __init__(self, swapped: _Optional[bool] = ..., value: _Optional[bytes] = ...) -> None: ...

class DeleteKeyRequest(_message.Message):
    __slots__ = ("job_id", "key")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    key: str
    def __init__(self, job_id: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class DeleteKeyResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("job_id", "rank", "member_secret", "progress", "stats", "last_event_seq", "answers")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMBER_SECRET_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    member_secret: str
    progress: _containers.RepeatedCompositeFieldContainer[_common_pb2.Progress]
    stats: _containers.RepeatedCompositeFieldContainer[_common_pb2.CollectiveStats]
    last_event_seq: int
    answers: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., member_secret: _Optional[str] = ..., progress: _Optional[_Iterable[_Union[_common_pb2.Progress, _Mapping]]] = ..., stats: _Optional[_Iterable[_Union[_common_pb2.CollectiveStats, _Mapping]]] = ..., last_event_seq: _Optional[int] = ..., answers: _Optional[int] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("kind", "ranks", "hosts", "reason", "details_json", "seq", "request_id")
    KIND_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAILS_JSON_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    kind: EventKind
    ranks: _containers.RepeatedScalarFieldContainer[int]
    hosts: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    details_json: str
    seq: int
    request_id: int
    def __init__(self, kind: _Optional[_Union[EventKind, str]] = ..., ranks: _Optional[_Iterable[int]] = ..., hosts: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ..., details_json: _Optional[str] = ..., seq: _Optional[int] = ..., request_id: _Optional[int] = ...) -> None: ...

class ReportFailureRequest(_message.Message):
    __slots__ = ("job_id", "rank", "member_secret", "kind", "reason", "details_json", "ranks")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMBER_SECRET_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAILS_JSON_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    member_secret: str
    kind: EventKind
    reason: str
    details_json: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., member_secret: _Optional[str] = ..., kind: _Optional[_Union[EventKind, str]] = ..., reason: _Optional[str] = ..., details_json: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class ReportFailureResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetProgressRequest(_message.Message):
    __slots__ = ("job_id", "group", "seq", "fresh_within_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FRESH_WITHIN_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group: str
    seq: int
    fresh_within_s: float
    def __init__(self, job_id: _Optional[str] = ..., group: _Optional[str] = ..., seq: _Optional[int] = ..., fresh_within_s: _Optional[float] = ...) -> None: ...

class GetProgressResponse(_message.Message):
    __slots__ = ("not_started",)
    NOT_STARTED_FIELD_NUMBER: _ClassVar[int]
    not_started: _containers.RepeatedCompositeFieldContainer[WaitingMember]
    def __init__(self, not_started: _Optional[_Iterable[_Union[WaitingMember, _Mapping]]] = ...) -> None: ...

class NewGroupRequest(_message.Message):
    __slots__ = ("job_id", "name", "ranks", "restore")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    restore: bool
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., restore: _Optional[bool] = ...) -> None: ...

class NewGroupResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FindGroupRequest(_message.Message):
    __slots__ = ("job_id", "name")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class FindGroupResponse(_message.Message):
    __slots__ = ("found", "ranks")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    found: bool
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, found: _Optional[bool] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("job_id", "rank", "member_secret", "progress", "cause_ranks", "cause_reason", "cause_unreachable")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMBER_SECRET_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    CAUSE_RANKS_FIELD_NUMBER: _ClassVar[int]
    CAUSE_REASON_FIELD_NUMBER: _ClassVar[int]
    CAUSE_UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    member_secret: str
    progress: _containers.RepeatedCompositeFieldContainer[_common_pb2.Progress]
    cause_ranks: _containers.RepeatedScalarFieldContainer[int]
    cause_reason: str
    cause_unreachable: bool
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., member_secret: _Optional[str] = ..., progress: _Optional[_Iterable[_Union[_common_pb2.Progress, _Mapping]]] = ..., cause_ranks: _Optional[_Iterable[int]] = ..., cause_reason: _Optional[str] = ..., cause_unreachable: _Optional[bool] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GroupStatus(_message.Message):
    __slots__ = ("name", "ranks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "world_size", "state", "members", "groups", "progress", "failure", "world_stats")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    WORLD_STATS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    world_size: int
    state: str
    members: _containers.RepeatedCompositeFieldContainer[_common_pb2.Member]
    groups: _containers.RepeatedCompositeFieldContainer[GroupStatus]
    progress: _containers.RepeatedCompositeFieldContainer[_common_pb2.Progress]
    failure: str
    world_stats: _containers.RepeatedCompositeFieldContainer[_common_pb2.CollectiveStats]
    def __init__(self, job_id: _Optional[str] = ..., world_size: _Optional[int] = ..., state: _Optional[str] = ..., members: _Optional[_Iterable[_Union[_common_pb2.Member, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[GroupStatus, _Mapping]]] = ..., progress: _Optional[_Iterable[_Union[_common_pb2.Progress, _Mapping]]] = ..., failure: _Optional[str] = ..., world_stats: _Optional[_Iterable[_Union[_common_pb2.CollectiveStats, _Mapping]]] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ...) -> None: ...

class BarrierMark(_message.Message):
    __slots__ = ("group", "generation")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    group: str
    generation: int
    def __init__(self, group: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class ReregisterRequest(_message.Message):
    __slots__ = ("job_id", "rank", "member_secret", "job_incarnation", "world_size", "num_nodes", "member", "barriers", "left_ranks", "last_event_seq")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMBER_SECRET_FIELD_NUMBER: _ClassVar[int]
    JOB_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    BARRIERS_FIELD_NUMBER: _ClassVar[int]
    LEFT_RANKS_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    member_secret: str
    job_incarnation: int
    world_size: int
    num_nodes: int
    member: _common_pb2.Member
    barriers: _containers.RepeatedCompositeFieldContainer[BarrierMark]
    left_ranks: _containers.RepeatedScalarFieldContainer[int]
    last_event_seq: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., member_secret: _Optional[str] = ..., job_incarnation: _Optional[int] = ..., world_size: _Optional[int] = ..., num_nodes: _Optional[int] = ..., member: _Optional[_Union[_common_pb2.Member, _Mapping]] = ..., barriers: _Optional[_Iterable[_Union[BarrierMark, _Mapping]]] = ..., left_ranks: _Optional[_Iterable[int]] = ..., last_event_seq: _Optional[int] = ...) -> None: ...

class ReregisterResponse(_message.Message):
    __slots__ = ("recovering",)
    RECOVERING_FIELD_NUMBER: _ClassVar[int]
    recovering: bool
    def __init__(self, recovering: _Optional[bool] = ...) -> None: ...
