"""Point-to-point messages between ranks of one host go through shared-memory rings (not gRPC), with
the same results and failure reports; real coordinator, real rank processes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import collsvc
from collsvc.client.backends.shm.frame_ring import supported
from tests.harness import coordinator, run_ranks

pytestmark = pytest.mark.skipif(not supported(), reason="frame rings need x86-64's memory ordering")

# 0 bytes, one small frame, several full frames with a remainder, more than a whole ring
SIZES = (0, 4096, (3 << 20) + 12, 9 << 20)


def exchange(comm: collsvc.Communicator) -> dict[str, Any]:
    """Every rank sends to its right neighbour and receives from its left one, for every size and two
    dtypes, interleaving tags; then a non-contiguous array and a recv into ``out=``."""
    n, me = comm.size, comm.rank
    right, left = (me + 1) % n, (me - 1) % n
    local = comm._job.transport.local_frames
    comm.barrier()  # every rank's inbox is bound by now: frames before this may have taken gRPC
    before = None if local is None else local.frames_sent
    for dtype in (np.float32, np.int16):
        for tag, nbytes in enumerate(SIZES):
            count = nbytes // np.dtype(dtype).itemsize
            comm.send((np.arange(count) % 1000 + me).astype(dtype), right, tag=tag)
        for tag in reversed(range(len(SIZES))):
            count = SIZES[tag] // np.dtype(dtype).itemsize
            got = comm.recv(left, tag=tag, shape=(count,), dtype=dtype)
            assert np.array_equal(got, (np.arange(count) % 1000 + left).astype(dtype)), (dtype, tag)
    matrix = np.arange(600, dtype=np.float64).reshape(20, 30) * (me + 1)
    comm.send(matrix[:, ::3], right, tag=9)
    out = np.empty((20, 10))
    comm.recv(left, tag=9, out=out)
    assert np.array_equal(out, (np.arange(600, dtype=np.float64).reshape(20, 30) * (left + 1))[:, ::3])
    comm.barrier()  # a rank that left makes the others' later calls fail: nobody leaves before the end
    return {"frames": None if local is None or before is None else local.frames_sent - before}


@pytest.mark.parametrize("world_size", [2, 3])
def test_messages_between_local_ranks_take_the_rings(world_size: int) -> None:
    with coordinator() as (_, address):
        result = run_ranks(exchange, world_size, address=address, timeout=120)
    frames = [value["frames"] for value in result.values]
    # Each rank sent 2 x (1 + 1 + 2 + 5) frames of at most 2 MiB and the array's, 19. Once the peer's
    # inbox is bound, a frame takes gRPC only when its ring stays full for 10 ms (a busy machine: the
    # 9 MiB messages fill the 8 MiB rings).
    assert all(count is not None and 12 <= count <= 19 for count in frames), frames


def test_without_shared_memory_messages_take_grpc() -> None:
    with coordinator() as (_, address):
        result = run_ranks(exchange, 2, address=address, env={"COLLSVC_SHM": "0"}, timeout=120)
    assert [value["frames"] for value in result.values] == [None, None]


def send_to_a_dead_peer(comm: collsvc.Communicator) -> str:
    """Rank 1 dies after a first message; rank 0 keeps sending to it until the job reports it."""
    if comm.rank == 1:
        comm.recv(0, shape=(4,), dtype=np.float32)
        import os

        os._exit(3)
    comm.send(np.ones(4, np.float32), 1)
    with pytest.raises(collsvc.RankFailedError) as caught:
        for _ in range(100_000):
            comm.send(np.ones(1024, np.float32), 1)
    assert caught.value.ranks == [1]
    return str(caught.value)


def test_a_dead_receiver_is_named() -> None:
    with coordinator() as (_, address):
        result = run_ranks(send_to_a_dead_peer, 2, address=address, timeout=120, allow_failures=True)
    sender, receiver = result.outcomes
    assert sender.error is None, sender.error
    assert "rank 1" in sender.value
    assert receiver.exitcode == 3
