from __future__ import annotations

import socket

import numpy as np
import pytest

from collsvc import errors
from collsvc.arrays import adapt, check_out_shape, from_host, is_writable, write_into
from collsvc.config import host_name, resolve_init
from collsvc.launch.launcher import Launcher
from collsvc.launch.spec import LaunchSpec
from collsvc.types import BFLOAT16, ReduceOp, check_op_dtype


def resolve(env: dict[str, str], **kw: object) -> object:
    args = {
        "coordinator": None,
        "world_size": None,
        "rank": None,
        "backend": "auto",
        "timeout": 10.0,
        "token": None,
        "job_id": None,
    }
    args.update(kw)
    return resolve_init(env=env, **args)  # type: ignore[arg-type]


def test_ours_win_over_torchrun_and_mpi() -> None:
    env = {
        "COLLSVC_COORDINATOR": "a:1",
        "MASTER_ADDR": "b",
        "MASTER_PORT": "2",
        "COLLSVC_WORLD_SIZE": "4",
        "WORLD_SIZE": "8",
        "RANK": "3",
        "OMPI_COMM_WORLD_RANK": "1",
        "LOCAL_RANK": "1",
        "COLLSVC_TOKEN": "t",
    }
    o = resolve(env)
    assert (o.coordinator, o.world_size, o.rank, o.local_rank_hint, o.token) == ("a:1", 4, 3, 1, "t")


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"MASTER_ADDR": "m", "MASTER_PORT": "5", "WORLD_SIZE": "2", "RANK": "1"}, ("m:5", 2, 1)),
        (
            {"COLLSVC_COORDINATOR": "c:1", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "2"},
            ("c:1", 3, 2),
        ),
        ({"COLLSVC_COORDINATOR": "c:1", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, ("c:1", 2, 0)),
        ({"COLLSVC_COORDINATOR": "c:1", "PMI_SIZE": "2", "PMI_RANK": "1"}, ("c:1", 2, 1)),
        (
            {"COLLSVC_COORDINATOR": "c:1", "COLLSVC_WORLD_SIZE": "4", "JOB_COMPLETION_INDEX": "3"},
            ("c:1", 4, 3),
        ),
        ({"COLLSVC_COORDINATOR": "c:1", "COLLSVC_WORLD_SIZE": "4"}, ("c:1", 4, None)),
    ],
)
def test_launcher_families(env: dict[str, str], expected: tuple[object, ...]) -> None:
    o = resolve(env)
    assert (o.coordinator, o.world_size, o.rank) == expected


def test_ranks_and_the_launcher_tell_the_host_by_one_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    assert host_name({"COLLSVC_HOST": "h1"}) == "h1"
    assert host_name({"COLLSVC_HOST": ""}) == host_name({}) == socket.gethostname()
    assert resolve({"COLLSVC_COORDINATOR": "c:1", "COLLSVC_WORLD_SIZE": "1", "COLLSVC_HOST": "h1"}).host == "h1"
    monkeypatch.setenv("COLLSVC_HOST", "h2")
    spec = LaunchSpec(command=["train.py"], nproc=1)
    assert Launcher(spec).host == "h2"
    assert Launcher(spec, host="given").host == "given"


def test_missing_coordinator_names_the_variables() -> None:
    with pytest.raises(ValueError, match="COLLSVC_COORDINATOR"):
        resolve({"WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="COLLSVC_WORLD_SIZE"):
        resolve({"COLLSVC_COORDINATOR": "x:1"})
    with pytest.raises(ValueError, match="outside"):
        resolve({"COLLSVC_COORDINATOR": "x:1", "WORLD_SIZE": "2", "RANK": "2"})
    with pytest.raises(ValueError, match="not an integer"):
        resolve({"COLLSVC_COORDINATOR": "x:1", "WORLD_SIZE": "two"})


def test_op_dtype_rules() -> None:
    check_op_dtype(ReduceOp.BXOR, np.dtype(bool))
    for op, dtype in [
        (ReduceOp.BAND, "float32"),
        (ReduceOp.MIN, "complex64"),
        (ReduceOp.AVG, "int32"),
        (ReduceOp.AVG, "bool"),
        (ReduceOp.SUM, "U3"),
        ("sum", "float32"),
    ]:
        with pytest.raises(TypeError):
            check_op_dtype(op, np.dtype(dtype))  # type: ignore[arg-type]


def test_error_round_trip_keeps_structure() -> None:
    for error in [
        errors.RankFailedError("x", [1, 2], ["a", "b"]),
        errors.CollectiveTimeoutError("x", [{"rank": 3, "host": "h"}]),
        errors.CollectiveMismatchError("x", {0: {"op": "a"}, 1: {"op": "b"}}),
        errors.AbortedError("x", "why"),
        errors.AuthenticationError("x"),
        errors.RendezvousError("x"),
    ]:
        rebuilt = errors.build_error(errors.reason_for(error), "x", errors.error_details(error))
        assert type(rebuilt) is type(error)
        assert errors.error_details(rebuilt) == errors.error_details(error)


def test_writable_reads_numpy_flags_and_takes_cupy_arrays_as_writable() -> None:
    read_only = np.zeros(3)
    read_only.flags.writeable = False
    assert is_writable(np.zeros(3)) and not is_writable(read_only)

    class CupyFlags:  # CuPy 14's flags: contiguity and ownership, no writeable (its arrays have no read-only mode)
        c_contiguous = True
        f_contiguous = True
        owndata = True

    class CupyLike:
        flags = CupyFlags()

    assert is_writable(CupyLike())


def test_numpy_and_bfloat16_adaptation() -> None:
    a = adapt(np.ones((2, 3), np.float32))
    assert (a.dtype, a.kind, a.on_gpu, a.shape) == ("float32", "numpy", False, (2, 3))
    b = adapt(np.ones(3, BFLOAT16))
    assert b.dtype == "bfloat16"
    with pytest.raises(TypeError):
        adapt([1, 2])
    with pytest.raises(TypeError):
        adapt(np.array(["a"]))
    with pytest.raises(ValueError):
        check_out_shape(np.empty(3, np.float32), (2,), "float32")
    with pytest.raises(TypeError):
        check_out_shape(np.empty(2, np.float64), (2,), "float32")


def test_torch_tensors_round_trip_zero_copy() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    a = adapt(t)
    assert a.kind == "torch" and a.dtype == "float32"
    a.array[0, 0] = 42.0  # zero-copy view of the tensor's memory
    assert float(t[0, 0]) == 42.0
    back = from_host(np.asarray(a.array) * 2, a)
    assert isinstance(back, torch.Tensor) and back.shape == (2, 3)
    bf = torch.ones(4, dtype=torch.bfloat16)
    ab = adapt(bf)
    assert ab.dtype == "bfloat16" and ab.array.dtype == BFLOAT16
    out = torch.zeros(4, dtype=torch.bfloat16)
    write_into(out, np.full(4, 3.0, dtype=BFLOAT16))
    assert float(out.sum()) == 12.0
    back_bf = from_host(np.full(4, 2.0, dtype=BFLOAT16), ab)
    assert back_bf.dtype == torch.bfloat16 and float(back_bf.sum()) == 8.0


def test_cpu_tensor_views_share_memory_and_leave_the_storage_resizable() -> None:
    torch = pytest.importorskip("torch")
    from collsvc.arrays import torch_cpu_view

    t = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    for tensor in (t, t.t(), t[:, 1], t[1:], t[0, 0], torch.ones(0, 3), torch.tensor([True, False])):
        view = torch_cpu_view(tensor)
        assert view is not None and view.tolist() == tensor.tolist() and view.shape == tuple(tensor.shape)
    view = torch_cpu_view(t)
    view[2, 3] = -1.0  # the tensor's own memory
    assert float(t[2, 3]) == -1.0
    t.untyped_storage().resize_(0)  # Tensor.numpy() would have made this an error
    t.resize_(5)
    kept = torch.full((4,), 2.0)
    view = torch_cpu_view(kept)
    del kept
    assert view.sum() == 8.0  # the view keeps its tensor alive
    for refused in (
        torch.ones(2, dtype=torch.bfloat16),  # numpy has no bfloat16 (it goes by DLPack)
        torch.ones(2, requires_grad=True),
        torch.ones(2, dtype=torch.complex64).conj(),
        torch.ones(2)._neg_view(),
        torch.ones(2).to_sparse(),
    ):
        assert torch_cpu_view(refused) is None


def test_a_numpy_scalar_is_refused_as_out_rather_than_silently_left_unwritten() -> None:
    from collsvc.client.operands import Operand

    scalar = np.complex64(1 + 2j)
    adapted = adapt(scalar, name="x")
    assert adapted.shape == () and not adapted.array.flags.writeable
    with pytest.raises(ValueError, match="numpy scalar"):
        Operand.of(adapted, scalar, scalar, False).check_out((), in_place_allowed=True)
    zero_d = np.array(scalar)
    Operand.of(adapt(zero_d), zero_d, zero_d, False).check_out((), in_place_allowed=True)  # a 0-d array is fine


def test_fast_path_setting() -> None:
    from collsvc.config import fast_path_enabled

    assert fast_path_enabled({}) and fast_path_enabled({"COLLSVC_FAST_PATH": "1"})
    assert not fast_path_enabled({"COLLSVC_FAST_PATH": "0"})
