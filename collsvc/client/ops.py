"""What each collective runs: validate the arguments, plan the work buffers, call the backend.

Each function here checks its arguments at once (before anything is sent) and returns a
:class:`Planned` call: the call's signature and a body that moves the data through a backend. The
Communicator numbers and issues it (inline, or on its worker thread with ``async_op``). The user's
arrays are adapted once, into :class:`~collsvc.client.operands.Operand` values that carry their
buffer state down to the backend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from collsvc.arrays import Adapted, adapt, is_writable
from collsvc.client.backends.base import Backend, Call, GroupSpec, Signature
from collsvc.client.operands import Operand, check_writable, empty
from collsvc.types import ReduceOp, check_compression, check_op_dtype, numpy_dtype

# ReduceOp names without Enum's Python-level property on every call.
_OP_NAME = {op: op.name for op in ReduceOp}


@dataclass(frozen=True)
class GroupView:
    """What the collectives need to know of their communicator."""

    name: str
    rank: int
    size: int
    global_ranks: tuple[int, ...]
    gpu_backend: bool  # the job's GPU arrays go through NCCL (else they are staged through the host)


@dataclass(frozen=True)
class Planned:
    """One collective, ready to be numbered and issued: ``body(call, backend)`` returns the result."""

    signature: Signature
    body: Callable[[Call, Backend], Any]
    on_gpu: bool
    stream: str | None = None  # the sequence the call counts in (default: the group's)
    spec: GroupSpec | None = None  # the members of the call (default: the group's)


def _operand(group: GroupView, x: Any, out: Any) -> Operand:
    a = adapt(x, name="x")
    return Operand.of(a, x, out, a.on_gpu and group.gpu_backend)


def _split_rows(shape: tuple[int, ...], size: int, what: str) -> tuple[int, ...]:
    if len(shape) == 0 or shape[0] % size:
        raise ValueError(f"{what}: x.shape[0] must be divisible by the communicator size {size}, got shape {shape}")
    return (shape[0] // size, *shape[1:])


def _gathered_shape(shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    return (size,) if len(shape) == 0 else (size * shape[0], *shape[1:])


def _operand_list(group: GroupView, xs: Sequence[Any], out: Any, what: str) -> list[Operand]:
    adapted = [adapt(x, name=f"x[{i}]") for i, x in enumerate(xs)]
    if not adapted:
        raise ValueError(f"{what}: the list of arrays is empty")
    dtypes = sorted({a.dtype for a in adapted})
    if len(dtypes) > 1:
        raise TypeError(f"{what}: a fused list needs one dtype, got {', '.join(dtypes)}; call once per dtype")
    if len({a.on_gpu for a in adapted}) > 1:
        raise TypeError(f"{what}: a fused list cannot mix host and GPU arrays")
    outs = list(out) if out is not None else [None] * len(adapted)
    if len(outs) != len(adapted):
        raise ValueError(f"{what}: out has {len(outs)} arrays for {len(adapted)} inputs")
    on_device = adapted[0].on_gpu and group.gpu_backend
    return [Operand.of(a, x, o, on_device) for a, x, o in zip(adapted, xs, outs, strict=True)]


def _pack(operands: list[Operand]) -> Any:
    """The arrays of a fused list, flattened one after another into one new buffer."""
    first = operands[0]
    buf = empty((sum(o.size for o in operands),), first.dtype, first.on_device)
    offset = 0
    for operand in operands:
        buf[offset : offset + operand.size] = operand.flat()
        offset += operand.size
    return buf


# ---- all_reduce / broadcast (in-place shaped) ------------------------------------------------------------
def all_reduce(group: GroupView, x: Any, op: ReduceOp, *, out: Any, compression: str | None = None) -> Planned:
    if isinstance(x, (list, tuple)):
        return _fused_in_place(group, "all_reduce", x, out, op=op, compression=compression)
    operand = _operand(group, x, out)
    check_op_dtype(op, numpy_dtype(operand.dtype))
    wire = _compression(compression, op, operand)
    operand.check_out(operand.shape, in_place_allowed=True)

    def body(call: Call, backend: Backend) -> Any:
        buffer = operand.work_buffer()
        backend.all_reduce(call, buffer.array, op)
        return operand.finish_buffer(buffer, operand.shape)

    signature = Signature.of("all_reduce", operand.dtype, operand.shape, _OP_NAME[op], compression=wire)
    return Planned(signature, body, operand.on_device)


def _compression(compression: str | None, op: ReduceOp, operand: Operand) -> str:
    """The checked ``compression`` of a reduction ("" for none), for its signature.

    Raises:
        ValueError / TypeError: as :func:`~collsvc.types.check_compression`, or GPU arrays on NCCL.
    """
    name = check_compression(compression, op, operand.dtype)
    if name and operand.on_device:
        raise ValueError(
            f"compression={name!r} is not supported for GPU arrays on the NCCL backend (NCCL moves them "
            "exactly); pass compression=None, or host arrays to compress the cross-host frames"
        )
    return name


def broadcast(group: GroupView, x: Any, src: int, *, out: Any) -> Planned:
    if isinstance(x, (list, tuple)):
        return _fused_in_place(group, "broadcast", x, out, root=src)
    operand = _operand(group, x, out)
    operand.check_out(operand.shape, in_place_allowed=True)

    def body(call: Call, backend: Backend) -> Any:
        if group.rank == src:
            # Backends only read the source's buffer: send straight from x, and make the source's own
            # result copy afterwards, off the other ranks' critical path.
            flat = operand.flat()
            if not is_writable(flat):  # backends take one buffer type for every rank
                flat = flat.copy()
            backend.broadcast(call, flat, src)
            if out is x:
                return out
            result = flat.reshape(operand.shape)
            return operand.finish(result if out is not None else result.copy())
        buffer = operand.landing_buffer(operand.shape)
        backend.broadcast(call, buffer.array, src)
        return operand.finish_buffer(buffer, operand.shape)

    return Planned(Signature.of("broadcast", operand.dtype, operand.shape, root=src), body, operand.on_device)


def _fused_in_place(
    group: GroupView,
    name: str,
    xs: Sequence[Any],
    out: Any,
    *,
    op: ReduceOp | None = None,
    root: int | None = None,
    compression: str | None = None,
) -> Planned:
    operands = _operand_list(group, xs, out, name)
    wire = ""
    if op is not None:
        check_op_dtype(op, numpy_dtype(operands[0].dtype))
        wire = _compression(compression, op, operands[0])
    for operand in operands:
        operand.check_out(operand.shape, in_place_allowed=True)
    total = sum(o.size for o in operands)

    def body(call: Call, backend: Backend) -> list[Any]:
        buf = _pack(operands)
        if op is not None:
            backend.all_reduce(call, buf, op)
        else:
            assert root is not None  # a fused broadcast always has a root
            backend.broadcast(call, buf, root)
        results, offset = [], 0
        for operand in operands:
            piece = buf[offset : offset + operand.size].reshape(operand.shape)
            offset += operand.size
            if operand.out is not None and operand.out is operand.x:
                results.append(operand.finish(piece))
            else:
                results.append(operand.finish(piece.copy()))
        return results

    signature = Signature.of(name, operands[0].dtype, (len(operands), total), _OP_NAME[op] if op else "", root, wire)
    return Planned(signature, body, operands[0].on_device)


# ---- gathers ------------------------------------------------------------------------------------------------
def all_gather(group: GroupView, x: Any, *, out: Any) -> Planned:
    if isinstance(x, (list, tuple)):
        return _all_gather_list(group, x, out)
    operand = _operand(group, x, out)
    result_shape = _gathered_shape(operand.shape, group.size)
    operand.check_out(result_shape, in_place_allowed=False)

    def body(call: Call, backend: Backend) -> Any:
        buffer = operand.result_buffer(result_shape)
        backend.all_gather(call, operand.flat(), buffer.array)
        return operand.finish_buffer(buffer, result_shape)

    return Planned(Signature.of("all_gather", operand.dtype, operand.shape), body, operand.on_device)


def _all_gather_list(group: GroupView, xs: Sequence[Any], out: Any) -> Planned:
    operands = _operand_list(group, xs, out, "all_gather")
    shapes = [_gathered_shape(o.shape, group.size) for o in operands]
    for operand, shape in zip(operands, shapes, strict=True):
        operand.check_out(shape, in_place_allowed=False)
    total = sum(o.size for o in operands)
    first = operands[0]

    def body(call: Call, backend: Backend) -> list[Any]:
        gathered = first.empty((group.size, total))
        backend.all_gather(call, _pack(operands), gathered.reshape(-1))
        results, offset = [], 0
        for operand, shape in zip(operands, shapes, strict=True):
            piece = gathered[:, offset : offset + operand.size].reshape(shape)
            offset += operand.size
            results.append(operand.finish(piece.copy()))
        return results

    return Planned(Signature.of("all_gather", first.dtype, (len(operands), total)), body, first.on_device)


def gather(group: GroupView, x: Any, dst: int, *, out: Any) -> Planned:
    operand = _operand(group, x, out)
    result_shape = _gathered_shape(operand.shape, group.size)
    is_root = group.rank == dst
    if is_root:
        operand.check_out(result_shape, in_place_allowed=False)

    def body(call: Call, backend: Backend) -> Any:
        if not is_root:
            backend.gather(call, operand.flat(), None, dst)
            return None
        buffer = operand.result_buffer(result_shape)
        backend.gather(call, operand.flat(), buffer.array, dst)
        return operand.finish_buffer(buffer, result_shape)

    return Planned(Signature.of("gather", operand.dtype, operand.shape, root=dst), body, operand.on_device)


# ---- reductions that scatter or root --------------------------------------------------------------------
def reduce(group: GroupView, x: Any, dst: int, op: ReduceOp, *, out: Any) -> Planned:
    is_root = group.rank == dst
    operand = _operand(group, x, out if is_root else None)
    check_op_dtype(op, numpy_dtype(operand.dtype))
    if is_root:
        operand.check_out(operand.shape, in_place_allowed=True)

    def body(call: Call, backend: Backend) -> Any:
        buffer = operand.work_buffer()
        backend.reduce(call, buffer.array, op, dst)
        return operand.finish_buffer(buffer, operand.shape) if is_root else None

    return Planned(Signature.of("reduce", operand.dtype, operand.shape, _OP_NAME[op], dst), body, operand.on_device)


def reduce_scatter(group: GroupView, x: Any, op: ReduceOp, *, out: Any, compression: str | None = None) -> Planned:
    operand = _operand(group, x, out)
    check_op_dtype(op, numpy_dtype(operand.dtype))
    wire = _compression(compression, op, operand)
    block_shape = _split_rows(operand.shape, group.size, "reduce_scatter")
    operand.check_out(block_shape, in_place_allowed=False)

    def body(call: Call, backend: Backend) -> Any:
        buffer = operand.result_buffer(block_shape)
        backend.reduce_scatter(call, operand.flat(), buffer.array, op)
        return operand.finish_buffer(buffer, block_shape)

    signature = Signature.of("reduce_scatter", operand.dtype, operand.shape, _OP_NAME[op], compression=wire)
    return Planned(signature, body, operand.on_device)


def scatter(group: GroupView, x: Any, src: int, *, out: Any) -> Planned:
    is_root = group.rank == src
    like: Adapted | None = None
    if x is None:
        if is_root:
            raise ValueError("scatter: the source rank must pass x")
        if out is None:
            raise ValueError("scatter: pass x (any array of the full shape) or out= on non-source ranks")
        target = adapt(out, name="out")
        full_shape = _gathered_shape(target.shape, group.size) if target.shape else (group.size,)
        operand = Operand(target, None, out, target.on_gpu and group.gpu_backend, target)
        like = target
    else:
        operand = _operand(group, x, out)
        full_shape = operand.shape
    block_shape = _split_rows(full_shape, group.size, "scatter")
    operand.check_out(block_shape, in_place_allowed=False)

    def body(call: Call, backend: Backend) -> Any:
        # Straight into a usable out: the root's apart from its input, the others' (which read nothing).
        buffer = operand.result_buffer(block_shape) if is_root else operand.landing_buffer(block_shape)
        backend.scatter(call, operand.flat() if is_root else None, buffer.array, src)
        return operand.finish_buffer(buffer, block_shape, like=like)

    return Planned(Signature.of("scatter", operand.dtype, full_shape, root=src), body, operand.on_device)


def all_to_all(group: GroupView, x: Any, *, out: Any) -> Planned:
    operand = _operand(group, x, out)
    _split_rows(operand.shape, group.size, "all_to_all")
    operand.check_out(operand.shape, in_place_allowed=False)

    def body(call: Call, backend: Backend) -> Any:
        buffer = operand.result_buffer(operand.shape)
        backend.all_to_all(call, operand.flat(), buffer.array)
        return operand.finish_buffer(buffer, operand.shape)

    return Planned(Signature.of("all_to_all", operand.dtype, operand.shape), body, operand.on_device)


# ---- point to point -----------------------------------------------------------------------------------------
def check_tag(tag: int) -> None:
    """Raises ValueError unless ``tag`` is a non-negative int."""
    if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
        raise ValueError(f"tag must be a non-negative int, got {tag!r}")


def p2p_stream(group: GroupView, src: int, dst: int, tag: int) -> str:
    """The stream that numbers the messages group rank ``src`` sends to ``dst`` with ``tag``."""
    return f"{group.name}/p2p/{group.global_ranks[src]}-{group.global_ranks[dst]}/{tag}"


def _p2p(group: GroupView, src: int, dst: int, tag: int) -> tuple[str, GroupSpec]:
    check_tag(tag)
    if src == dst:
        raise ValueError(f"rank {src} cannot send to itself")
    ranks = group.global_ranks
    return p2p_stream(group, src, dst, tag), GroupSpec(
        group.name, (ranks[src], ranks[dst]), 0 if group.rank == src else 1
    )


def send(group: GroupView, x: Any, dst: int, tag: int) -> Planned:
    stream, spec = _p2p(group, group.rank, dst, tag)
    operand = _operand(group, x, None)

    def body(call: Call, backend: Backend) -> None:
        backend.send(call, operand.flat(), 1)

    return Planned(Signature.of("p2p", operand.dtype, operand.shape), body, operand.on_device, stream, spec)


def recv(group: GroupView, src: int, tag: int, *, out: Any, shape: Any, dtype: Any) -> Planned:
    stream, spec = _p2p(group, src, group.rank, tag)
    if out is not None:
        target = adapt(out, name="out")
        check_writable(target)
    elif shape is not None and dtype is not None:
        dt = numpy_dtype("bfloat16") if dtype == "bfloat16" else np.dtype(dtype)
        dims = (int(shape),) if isinstance(shape, int) else tuple(int(d) for d in shape)
        target = adapt(np.empty(dims, dt))
    else:
        raise ValueError("recv needs out= or both shape= and dtype=")
    operand = Operand(target, None, out, target.on_gpu and group.gpu_backend, target)

    def body(call: Call, backend: Backend) -> Any:
        host_out = out is not None and not operand.on_device and not target.on_gpu
        if host_out and target.array.flags.c_contiguous and target.array.flags.writeable:
            backend.recv(call, target.array.reshape(-1), 0)  # straight into the caller's array
            return out
        result = operand.empty(operand.shape)
        backend.recv(call, result.reshape(-1), 0)
        return operand.finish(result)

    return Planned(Signature.of("p2p", operand.dtype, operand.shape), body, operand.on_device, stream, spec)
