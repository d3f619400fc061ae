"""Array plumbing of each collective: validate, build work buffers, call the backend, return results.

Work buffers are flat and contiguous: numpy on the host (the ring backend; CUDA arrays are staged), or
CuPy on the device when the job uses NCCL and the array is on the GPU. ``out is x`` works in place on
the caller's memory where it is contiguous and writable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from collsvc.arrays import Adapted, adapt, check_out_shape, from_device, from_host, to_host, write_into
from collsvc.client.backends.base import Call, GroupSpec, Signature
from collsvc.types import ReduceOp, check_op_dtype, numpy_dtype

if TYPE_CHECKING:
    from collsvc.client.communicator import Communicator


def _on_device(comm: Communicator, a: Adapted) -> bool:
    return a.on_gpu and comm._job.nccl is not None


def _empty(shape: tuple[int, ...], dtype: str, on_device: bool) -> Any:
    if on_device:
        import cupy

        return cupy.empty(shape, dtype=np.uint16 if dtype == "bfloat16" else numpy_dtype(dtype))
    return np.empty(shape, dtype=numpy_dtype(dtype))


def _source(a: Adapted, on_device: bool) -> Any:
    return a.array if on_device else to_host(a)


def _flat(a: Adapted, on_device: bool) -> Any:
    """A flat contiguous read-only-use view of the input (copied only when not contiguous)."""
    arr = _source(a, on_device)
    if on_device:
        import cupy

        return cupy.ascontiguousarray(arr).reshape(-1)
    return np.ascontiguousarray(arr).reshape(-1)


def _usable_in_place(arr: Any, a: Adapted, on_device: bool) -> bool:
    return (on_device or not a.on_gpu) and bool(arr.flags.c_contiguous) and bool(arr.flags.writeable)


def _work_copy(a: Adapted, on_device: bool, x: Any, out: Any) -> tuple[Any, bool]:
    """(flat buffer the backend may overwrite, whether it is the caller's ``out`` memory).

    ``out is x`` works in place; another contiguous ``out`` of the same kind receives a copy of the
    input and is worked on in place (no temporary, no second copy); otherwise a fresh copy.
    """
    arr = _source(a, on_device)
    if out is not None and out is x and _usable_in_place(arr, a, on_device):
        return arr.reshape(-1), True
    if out is not None and out is not x:
        target = adapt(out, name="out")
        dest = _source(target, on_device)
        if target.on_gpu == a.on_gpu and _usable_in_place(dest, target, on_device):
            dest[...] = arr
            return dest.reshape(-1), True
    if on_device:
        import cupy

        return cupy.array(arr, copy=True, order="C").reshape(-1), False
    return np.array(arr, copy=True, order="C").reshape(-1), False


def _landing_buffer(a: Adapted, on_device: bool, x: Any, out: Any) -> tuple[Any, bool]:
    """A flat buffer for a result that overwrites everything (broadcast on non-source ranks): the
    caller's ``out`` (or ``x`` when ``out is x``) when usable, else a fresh array; nothing is copied in."""
    if out is not None:
        target = a if out is x else adapt(out, name="out")
        dest = _source(target, on_device)
        if target.on_gpu == a.on_gpu and _usable_in_place(dest, target, on_device):
            return dest.reshape(-1), True
    return _empty((int(np.prod(a.shape, dtype=np.int64)),), a.dtype, on_device), False


def _finish(result: Any, a: Adapted, out: Any, shared: bool, on_device: bool) -> Any:
    if out is not None:
        if not shared:
            write_into(out, result)
        return out
    return from_device(result, a) if on_device else from_host(result, a)


def _check_out(out: Any, x: Any, shape: tuple[int, ...], dtype: str) -> None:
    if out is not None and out is not x:
        check_out_shape(out, shape, dtype)
    elif out is not None and tuple(adapt(out).shape) != shape:
        raise ValueError(f"out is x, but the result has shape {shape}, not {tuple(adapt(out).shape)}")


def _reduce_check(op: ReduceOp, a: Adapted) -> None:
    check_op_dtype(op, numpy_dtype(a.dtype))


def _split_rows(shape: tuple[int, ...], size: int, what: str) -> tuple[int, ...]:
    if len(shape) == 0 or shape[0] % size:
        raise ValueError(f"{what}: x.shape[0] must be divisible by the communicator size {size}, got shape {shape}")
    return (shape[0] // size, *shape[1:])


def _gathered_shape(shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    return (size,) if len(shape) == 0 else (size * shape[0], *shape[1:])


def _adapt_list(xs: Sequence[Any], out: Any, what: str) -> tuple[list[Adapted], list[Any]]:
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
    return adapted, outs


def _pack(adapted: list[Adapted], sizes: list[int], dtype: str, on_device: bool) -> Any:
    """The arrays of a fused list, flattened one after another into one new buffer."""
    buf = _empty((sum(sizes),), dtype, on_device)
    offset = 0
    for a, n in zip(adapted, sizes, strict=True):
        buf[offset : offset + n] = _flat(a, on_device)
        offset += n
    return buf


# ---- all_reduce / broadcast (in-place shaped) ------------------------------------------------------------
def all_reduce(comm: Communicator, x: Any, op: ReduceOp, *, out: Any, async_op: bool) -> Any:
    if isinstance(x, (list, tuple)):
        return _fused_in_place(comm, "all_reduce", x, out, async_op, op=op)
    a = adapt(x, name="x")
    _reduce_check(op, a)
    _check_out(out, x, a.shape, a.dtype)
    dev = _on_device(comm, a)

    def body(call: Call, backend: Any) -> Any:
        buf, shared = _work_copy(a, dev, x, out)
        backend.all_reduce(call, buf, op)
        return _finish(buf.reshape(a.shape), a, out, shared, dev)

    return comm._issue(Signature("all_reduce", a.dtype, a.shape, op.name), body, async_op=async_op, on_gpu=dev)


def broadcast(comm: Communicator, x: Any, src: int, *, out: Any, async_op: bool) -> Any:
    if isinstance(x, (list, tuple)):
        return _fused_in_place(comm, "broadcast", x, out, async_op, root=src)
    a = adapt(x, name="x")
    _check_out(out, x, a.shape, a.dtype)
    dev = _on_device(comm, a)

    def body(call: Call, backend: Any) -> Any:
        if comm.rank == src:
            # Backends only read the source's buffer: send straight from x, and make the source's own
            # result copy afterwards, off the other ranks' critical path.
            flat = _flat(a, dev)
            if not flat.flags.writeable:  # backends take one buffer type for every rank
                flat = flat.copy()
            backend.broadcast(call, flat, src)
            if out is x:
                return out
            if out is not None:
                write_into(out, flat.reshape(a.shape))
                return out
            return _finish(flat.reshape(a.shape).copy(), a, None, False, dev)
        buf, shared = _landing_buffer(a, dev, x, out)
        backend.broadcast(call, buf, src)
        return _finish(buf.reshape(a.shape), a, out, shared, dev)

    return comm._issue(Signature("broadcast", a.dtype, a.shape, root=src), body, async_op=async_op, on_gpu=dev)


def _fused_in_place(
    comm: Communicator,
    name: str,
    xs: Sequence[Any],
    out: Any,
    async_op: bool,
    *,
    op: ReduceOp | None = None,
    root: int | None = None,
) -> Any:
    adapted, outs = _adapt_list(xs, out, name)
    if op is not None:
        _reduce_check(op, adapted[0])
    for a, o, x in zip(adapted, outs, xs, strict=False):
        _check_out(o, x, a.shape, a.dtype)
    dev = _on_device(comm, adapted[0])
    sizes = [int(np.prod(a.shape, dtype=np.int64)) for a in adapted]
    total = sum(sizes)
    dtype = adapted[0].dtype

    def body(call: Call, backend: Any) -> list[Any]:
        buf = _pack(adapted, sizes, dtype, dev)
        if op is not None:
            backend.all_reduce(call, buf, op)
        else:
            backend.broadcast(call, buf, root)
        results, offset = [], 0
        for a, o, n, x in zip(adapted, outs, sizes, xs, strict=False):
            piece = buf[offset : offset + n].reshape(a.shape)
            offset += n
            if o is not None and o is x:
                write_into(o, piece)
                results.append(o)
            else:
                results.append(_finish(piece.copy(), a, o, False, dev))
        return results

    signature = Signature(name, dtype, (len(adapted), total), op.name if op else "", root)
    return comm._issue(signature, body, async_op=async_op, on_gpu=dev)


# ---- gathers ------------------------------------------------------------------------------------------------
def all_gather(comm: Communicator, x: Any, *, out: Any, async_op: bool) -> Any:
    if isinstance(x, (list, tuple)):
        return _all_gather_list(comm, x, out, async_op)
    a = adapt(x, name="x")
    result_shape = _gathered_shape(a.shape, comm.size)
    _check_out(out, None, result_shape, a.dtype)
    dev = _on_device(comm, a)

    def body(call: Call, backend: Any) -> Any:
        result = _empty(result_shape, a.dtype, dev)
        backend.all_gather(call, _flat(a, dev), result.reshape(-1))
        return _finish(result, a, out, False, dev)

    return comm._issue(Signature("all_gather", a.dtype, a.shape), body, async_op=async_op, on_gpu=dev)


def _all_gather_list(comm: Communicator, xs: Sequence[Any], out: Any, async_op: bool) -> Any:
    adapted, outs = _adapt_list(xs, out, "all_gather")
    shapes = [_gathered_shape(a.shape, comm.size) for a in adapted]
    for o, a, s in zip(outs, adapted, shapes, strict=False):
        _check_out(o, None, s, a.dtype)
    dev = _on_device(comm, adapted[0])
    sizes = [int(np.prod(a.shape, dtype=np.int64)) for a in adapted]
    total = sum(sizes)
    dtype = adapted[0].dtype

    def body(call: Call, backend: Any) -> list[Any]:
        src = _pack(adapted, sizes, dtype, dev)
        gathered = _empty((comm.size, total), dtype, dev)
        backend.all_gather(call, src, gathered.reshape(-1))
        results, offset = [], 0
        for a, o, n, shape in zip(adapted, outs, sizes, shapes, strict=False):
            piece = gathered[:, offset : offset + n].reshape(shape)
            offset += n
            results.append(_finish(piece.copy(), a, o, False, dev))
        return results

    return comm._issue(Signature("all_gather", dtype, (len(adapted), total)), body, async_op=async_op, on_gpu=dev)


def gather(comm: Communicator, x: Any, dst: int, *, out: Any, async_op: bool) -> Any:
    a = adapt(x, name="x")
    result_shape = _gathered_shape(a.shape, comm.size)
    is_root = comm.rank == dst
    if is_root:
        _check_out(out, None, result_shape, a.dtype)
    dev = _on_device(comm, a)

    def body(call: Call, backend: Any) -> Any:
        result = _empty(result_shape, a.dtype, dev) if is_root else None
        backend.gather(call, _flat(a, dev), None if result is None else result.reshape(-1), dst)
        return _finish(result, a, out, False, dev) if is_root else None

    return comm._issue(Signature("gather", a.dtype, a.shape, root=dst), body, async_op=async_op, on_gpu=dev)


# ---- reductions that scatter or root --------------------------------------------------------------------
def reduce(comm: Communicator, x: Any, dst: int, op: ReduceOp, *, out: Any, async_op: bool) -> Any:
    a = adapt(x, name="x")
    _reduce_check(op, a)
    is_root = comm.rank == dst
    if is_root:
        _check_out(out, x, a.shape, a.dtype)
    dev = _on_device(comm, a)

    def body(call: Call, backend: Any) -> Any:
        buf, shared = _work_copy(a, dev, x, out if is_root else None)
        backend.reduce(call, buf, op, dst)
        return _finish(buf.reshape(a.shape), a, out, shared, dev) if is_root else None

    return comm._issue(Signature("reduce", a.dtype, a.shape, op.name, dst), body, async_op=async_op, on_gpu=dev)


def reduce_scatter(comm: Communicator, x: Any, op: ReduceOp, *, out: Any, async_op: bool) -> Any:
    a = adapt(x, name="x")
    _reduce_check(op, a)
    block_shape = _split_rows(a.shape, comm.size, "reduce_scatter")
    _check_out(out, None, block_shape, a.dtype)
    dev = _on_device(comm, a)

    def body(call: Call, backend: Any) -> Any:
        result = _empty(block_shape, a.dtype, dev)
        backend.reduce_scatter(call, _flat(a, dev), result.reshape(-1), op)
        return _finish(result, a, out, False, dev)

    return comm._issue(Signature("reduce_scatter", a.dtype, a.shape, op.name), body, async_op=async_op, on_gpu=dev)


def scatter(comm: Communicator, x: Any, src: int, *, out: Any, async_op: bool) -> Any:
    is_root = comm.rank == src
    if x is None:
        if is_root:
            raise ValueError("scatter: the source rank must pass x")
        if out is None:
            raise ValueError("scatter: pass x (any array of the full shape) or out= on non-source ranks")
        target = adapt(out, name="out")
        full_shape = _gathered_shape(target.shape, comm.size) if target.shape else (comm.size,)
        a = Adapted(target.array, target.dtype, target.kind, target.on_gpu, None)
    else:
        a = adapt(x, name="x")
        full_shape = a.shape
    block_shape = _split_rows(full_shape, comm.size, "scatter")
    _check_out(out, None, block_shape, a.dtype)
    dev = _on_device(comm, a)

    def body(call: Call, backend: Any) -> Any:
        result = _empty(block_shape, a.dtype, dev)
        backend.scatter(call, _flat(a, dev) if is_root else None, result.reshape(-1), src)
        like = a if a.source is not None else adapt(out)
        return _finish(result, like, out, False, dev)

    return comm._issue(Signature("scatter", a.dtype, full_shape, root=src), body, async_op=async_op, on_gpu=dev)


def all_to_all(comm: Communicator, x: Any, *, out: Any, async_op: bool) -> Any:
    a = adapt(x, name="x")
    _split_rows(a.shape, comm.size, "all_to_all")
    _check_out(out, None, a.shape, a.dtype)
    dev = _on_device(comm, a)

    def body(call: Call, backend: Any) -> Any:
        result = _empty(a.shape, a.dtype, dev)
        backend.all_to_all(call, _flat(a, dev), result.reshape(-1))
        return _finish(result, a, out, False, dev)

    return comm._issue(Signature("all_to_all", a.dtype, a.shape), body, async_op=async_op, on_gpu=dev)


# ---- point to point -----------------------------------------------------------------------------------------
def _p2p(comm: Communicator, src: int, dst: int, tag: int) -> tuple[str, GroupSpec]:
    if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
        raise ValueError(f"tag must be a non-negative int, got {tag!r}")
    if src == dst:
        raise ValueError(f"rank {src} cannot send to itself")
    ranks = comm.global_ranks
    stream = f"{comm.name}/p2p/{ranks[src]}-{ranks[dst]}/{tag}"
    return stream, GroupSpec(comm.name, (ranks[src], ranks[dst]), 0 if comm.rank == src else 1)


def send(comm: Communicator, x: Any, dst: int, tag: int) -> None:
    stream, spec = _p2p(comm, comm.rank, dst, tag)
    a = adapt(x, name="x")
    dev = _on_device(comm, a)

    def body(call: Call, backend: Any) -> None:
        backend.send(call, _flat(a, dev), 1)

    comm._issue(Signature("p2p", a.dtype, a.shape), body, on_gpu=dev, stream=stream, spec=spec)


def recv(comm: Communicator, src: int, tag: int, *, out: Any, shape: Any, dtype: Any) -> Any:
    stream, spec = _p2p(comm, src, comm.rank, tag)
    if out is not None:
        a = adapt(out, name="out")
    elif shape is not None and dtype is not None:
        dt = numpy_dtype("bfloat16") if dtype == "bfloat16" else np.dtype(dtype)
        dims = (int(shape),) if isinstance(shape, int) else tuple(int(d) for d in shape)
        a = adapt(np.empty(dims, dt))
    else:
        raise ValueError("recv needs out= or both shape= and dtype=")
    dev = _on_device(comm, a)

    def body(call: Call, backend: Any) -> Any:
        if out is not None and not dev and not a.on_gpu and a.array.flags.c_contiguous and a.array.flags.writeable:
            backend.recv(call, a.array.reshape(-1), 0)
            return out
        result = _empty(a.shape, a.dtype, dev)
        backend.recv(call, result.reshape(-1), 0)
        return _finish(result, a, out, False, dev)

    return comm._issue(Signature("p2p", a.dtype, a.shape), body, on_gpu=dev, stream=stream, spec=spec)
