from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PingRequest(_message.Message):
    __slots__ = ("job_id", "from_rank")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_RANK_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    from_rank: int
    def __init__(self, job_id: _Optional[str] = ..., from_rank: _Optional[int] = ...) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("rank",)
    RANK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    def __init__(self, rank: _Optional[int] = ...) -> None: ...
