"""Each torch collective as collsvc Communicator calls.

Every function validates locally, issues its calls through an :class:`Issuer` and returns
``(calls, outputs, finish)``: the collsvc calls, the tensors the operation writes, and what to run on
the calls' results once they are done (copy into outputs that could not be written in place).
Tensors are passed detached (torch refuses DLPack export of tensors that require grad; detaching
shares their memory), so in-place results land in the caller's tensors with no copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from collsvc.errors import CollectiveMismatchError
from collsvc.torch import _sparse
from collsvc.torch._host_arrays import flat_host_arrays, host_array
from collsvc.torch._issuing import SUM, Issuer
from collsvc.torch._work import Finisher
from collsvc.types import ReduceOp

Parts = tuple[list[Any], list[torch.Tensor], Finisher | None]

_RED: Any = dist.ReduceOp.RedOpType
_OPS = {
    _RED.SUM: ReduceOp.SUM,
    _RED.PRODUCT: ReduceOp.PRODUCT,
    _RED.MIN: ReduceOp.MIN,
    _RED.MAX: ReduceOp.MAX,
    _RED.BAND: ReduceOp.BAND,
    _RED.BOR: ReduceOp.BOR,
    _RED.BXOR: ReduceOp.BXOR,
    _RED.AVG: ReduceOp.AVG,
}
_OPS_BY_VALUE = {int(kind): ours for kind, ours in _OPS.items()}


def reduce_op(op: Any) -> tuple[ReduceOp, Any]:
    """(collsvc op, pre-multiplier or None) for a torch ``ReduceOp`` (PREMUL_SUM = scale, then SUM).

    Raises:
        ValueError: an op collsvc does not know, or PREMUL_SUM on a torch that hides its factor.
    """
    given: Any = op
    if given == SUM:  # the common op first: ~0.3 us, where the lookup below costs ~1.5 us
        return ReduceOp.SUM, None
    kind = given if isinstance(given, _RED) else getattr(given, "op", given)  # a bare RedOpType, or a ReduceOp
    try:
        value = int(kind)
    except (TypeError, ValueError):
        value = -1  # not a reduce op at all
    found = _OPS_BY_VALUE.get(value)  # int keys: pybind's enum hashing and == cost ~1 us each
    if found is not None:
        return found, None
    if value == int(_RED.PREMUL_SUM):
        factor = getattr(given, "factor", None)
        if factor is None:
            raise ValueError(
                f"reduce op PREMUL_SUM needs torch's ReduceOp.factor, which torch {torch.__version__} does not give "
                "Python backends (torch 2.13 does); scale the tensor and use SUM, or upgrade torch"
            )
        return ReduceOp.SUM, factor
    raise ValueError(f"reduce op {op} is not supported by the collsvc backend")


def single(tensors: Sequence[Any]) -> Any:
    """The one tensor (or tensor list) of torch's one-entry-per-device argument lists.

    Raises:
        ValueError: not exactly one entry (collsvc runs one device per process).
    """
    if len(tensors) != 1:
        raise ValueError(f"the collsvc backend takes one tensor (list) per process, got {len(tensors)}")
    return tensors[0]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A flat detached tensor: a view of ``t`` when contiguous, else a contiguous copy."""
    return t.detach().reshape(-1)


def _flat_out(t: torch.Tensor) -> torch.Tensor | None:
    """A flat view of ``t`` to receive results in place, or None when ``t`` is not contiguous."""
    return t.detach().view(-1) if t.is_contiguous() else None


def _copy_result(output: torch.Tensor) -> Finisher:
    """Copies the single call's result into ``output`` (for outputs that could not take it in place)."""

    def finish(results: list[Any]) -> None:
        output.detach().copy_(results[0].view(output.shape))

    return finish


def merge(parts: Sequence[Parts]) -> Parts:
    """Several operations as one: all their calls, all their outputs, each finisher on its own results."""
    calls: list[Any] = []
    outputs: list[torch.Tensor] = []
    spans: list[tuple[int, int, Finisher | None]] = []
    for part_calls, part_outputs, finish in parts:
        spans.append((len(calls), len(calls) + len(part_calls), finish))
        calls.extend(part_calls)
        outputs.extend(part_outputs)

    def finish_all(results: list[Any]) -> None:
        for start, stop, finish in spans:
            if finish is not None:
                finish(results[start:stop])

    return calls, outputs, finish_all


# ---- reductions ------------------------------------------------------------------------------------------
def all_reduce(comm: Issuer, tensors: list[torch.Tensor], op: Any) -> Parts:
    red, factor = reduce_op(op)
    if not tensors:
        raise ValueError("allreduce needs at least one tensor")
    if factor is None and len(tensors) == 1:
        # The common call (one dense CPU tensor): its numpy view, repeated calls take the fast path.
        host = host_array(tensors[0], held=comm.inline)
        if host is not None:
            return [comm.all_reduce(host, red, out=host)], list(tensors), None
    if _sparse.is_sparse(tensors):
        return _sparse.all_reduce(comm.comm, tensors, red, factor)
    views = [t.detach() for t in tensors]
    if factor is not None:
        for v in views:
            v.mul_(factor)  # in place: the reduction overwrites these tensors anyway
    if len(views) == 1:
        return [comm.all_reduce(views[0], red, out=views[0])], list(tensors), None
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for v in views:
        by_dtype.setdefault(v.dtype, []).append(v)
    # One fused transfer per dtype; results are written back into the caller's tensors.
    calls = [comm.all_reduce(group, red, out=group) for group in by_dtype.values()]
    return calls, list(tensors), None


def reduce(comm: Issuer, tensor: torch.Tensor, root: int, op: Any) -> Parts:
    red, factor = reduce_op(op)
    view = tensor.detach()
    source = view * factor if factor is not None else view
    if comm.rank == root:
        return [comm.reduce(source, root, red, out=view)], [tensor], None
    return [comm.reduce(source, root, red)], [tensor], None


def reduce_scatter(comm: Issuer, output: torch.Tensor, input: torch.Tensor, op: Any) -> Parts:  # noqa: A002
    red, factor = reduce_op(op)
    if input.numel() != output.numel() * comm.size:
        raise ValueError(
            f"reduce_scatter_tensor: input has {input.numel()} elements, expected output's "
            f"{output.numel()} x group size {comm.size}"
        )
    hosts = flat_host_arrays(input, output, held=comm.inline) if factor is None else None
    if hosts is not None:  # CPU tensors as numpy views: repeated calls take the Communicator's fast path
        return [comm.reduce_scatter(hosts[0], red, out=hosts[1])], [output], None
    source = _flat(input)
    if factor is not None:
        source = source * factor
    target = _flat_out(output)
    call = comm.reduce_scatter(source, red, out=target)
    if target is not None:
        return [call], [output], None
    return [call], [output], _copy_result(output)


def reduce_scatter_list(comm: Issuer, output: torch.Tensor, inputs: list[torch.Tensor], op: Any) -> Parts:
    if len(inputs) != comm.size:
        raise ValueError(f"reduce_scatter: {len(inputs)} input tensors for a group of {comm.size}")
    if any(t.numel() != output.numel() for t in inputs):
        raise ValueError("reduce_scatter: every input tensor must have the output's number of elements")
    stacked = torch.cat([_flat(t) for t in inputs])
    return reduce_scatter(comm, output, stacked, op)


# ---- broadcast and gathers ----------------------------------------------------------------------------------
def broadcast(comm: Issuer, tensors: list[torch.Tensor], root: int) -> Parts:
    if len(tensors) == 1:
        host = host_array(tensors[0], held=comm.inline)  # repeated calls of one CPU tensor take the fast path
        if host is not None:
            return [comm.broadcast(host, root, out=host)], list(tensors), None
    views = [t.detach() for t in tensors]
    if len(views) == 1:
        return [comm.broadcast(views[0], root, out=views[0])], list(tensors), None
    return [comm.broadcast(views, root, out=views)], list(tensors), None


def _copy_blocks(gathered: torch.Tensor, outputs: Sequence[torch.Tensor], block: int) -> None:
    for i, out in enumerate(outputs):
        out.detach().copy_(gathered[i * block : i * block + out.numel()].view(out.shape))


def all_gather_list(comm: Issuer, outputs: list[torch.Tensor], input: torch.Tensor) -> Parts:  # noqa: A002
    if len(outputs) != comm.size:
        raise ValueError(f"all_gather: {len(outputs)} output tensors for a group of {comm.size}")
    # Uneven outputs (torch allows them): every rank pads its block to the largest one, once every rank
    # checked the sizes agree (a rank that sees even sizes calls all_gather at once: its peers' size
    # check then meets a different call, and collsvc's own check raises CollectiveMismatchError).
    sizes = [o.numel() for o in outputs]
    block = sizes[0] if len(set(sizes)) == 1 else _agreed_gather_block(comm, input.numel(), sizes)
    source = _flat(input)
    if source.numel() < block:
        source = torch.cat([source, source.new_zeros(block - source.numel())])
    call = comm.all_gather(source)
    return [call], list(outputs), lambda results: _copy_blocks(results[0], outputs, block)


def all_gather(comm: Issuer, output: torch.Tensor, input: torch.Tensor) -> Parts:  # noqa: A002
    if output.numel() != input.numel() * comm.size:
        raise ValueError(
            f"all_gather_into_tensor: output has {output.numel()} elements, expected input's "
            f"{input.numel()} x group size {comm.size}"
        )
    hosts = flat_host_arrays(input, output, held=comm.inline)
    if hosts is not None:  # CPU tensors as numpy views: repeated calls take the Communicator's fast path
        return [comm.all_gather(hosts[0], out=hosts[1])], [output], None
    target = _flat_out(output)
    call = comm.all_gather(_flat(input), out=target)
    if target is not None:
        return [call], [output], None
    return [call], [output], _copy_result(output)


def gather(comm: Issuer, outputs: list[torch.Tensor], input: torch.Tensor, root: int) -> Parts:  # noqa: A002
    if comm.rank == root and len(outputs) != comm.size:
        raise ValueError(f"gather: {len(outputs)} output tensors on the root for a group of {comm.size}")
    call = comm.gather(_flat(input), root)
    if comm.rank != root:
        return [call], [], None
    return [call], list(outputs), lambda results: _copy_blocks(results[0], outputs, input.numel())


def scatter(comm: Issuer, output: torch.Tensor, inputs: list[torch.Tensor], root: int) -> Parts:
    target = output.detach().view(-1) if output.is_contiguous() else torch.empty_like(output).view(-1)
    if comm.rank == root:
        if len(inputs) != comm.size or any(t.numel() != output.numel() for t in inputs):
            raise ValueError(f"scatter: the root needs {comm.size} input tensors of the output's size")
        source: torch.Tensor | None = torch.cat([_flat(t) for t in inputs])
    else:
        source = None
    call = comm.scatter(source, root, out=target)
    if output.is_contiguous():
        return [call], [output], None
    return [call], [output], _copy_result(output)


# ---- all to all ------------------------------------------------------------------------------------------
def all_to_all_single(
    comm: Issuer,
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002
    output_splits: list[int],
    input_splits: list[int],
) -> Parts:
    size = comm.size
    rows_in = input.shape[0] if input.dim() else 1
    row = input[0].numel() if input.dim() and rows_in else max(input.numel(), 1)
    in_splits = list(input_splits) or [rows_in // size] * size
    out_splits = list(output_splits) or [(output.shape[0] if output.dim() else 1) // size] * size
    if len(in_splits) != size or len(out_splits) != size:
        raise ValueError(f"all_to_all_single: split sizes need {size} entries, got {in_splits} and {out_splits}")
    if sum(in_splits) * row != input.numel() or sum(out_splits) * row != output.numel():
        raise ValueError("all_to_all_single: split sizes do not add up to the tensors' first dimension")
    if len(set(in_splits)) == 1 and len(set(out_splits)) == 1 and in_splits[0] == out_splits[0]:
        target = _flat_out(output)
        call = comm.all_to_all(_flat(input), out=target)
        if target is not None:
            return [call], [output], None
        return [call], [output], _copy_result(output)
    # Uneven splits: every rank pads its blocks to the largest block of any rank (agreed first).
    widest = _agreed_widest_block(comm, in_splits, out_splits)
    padded = input.new_zeros((size, widest * row))
    flat_in = _flat(input)
    offset = 0
    for j, rows in enumerate(in_splits):
        padded[j, : rows * row] = flat_in[offset : offset + rows * row]
        offset += rows * row
    call = comm.all_to_all(padded.view(-1))

    def finish(results: list[Any]) -> None:
        received = results[0].view(size, widest * row)
        flat_out = output.detach().view(-1) if output.is_contiguous() else None
        pieces = [received[j, : rows * row] for j, rows in enumerate(out_splits)]
        joined = torch.cat(pieces) if pieces else received.new_zeros(0)
        if flat_out is not None:
            flat_out.copy_(joined)
        else:
            output.detach().copy_(joined.view(output.shape))

    return [call], [output], finish


def _raise_on_disagreement(op: str, wrong: list[str], details: dict[int, Any]) -> None:
    """Raises the same :class:`CollectiveMismatchError` on every rank when ``wrong`` names disagreements
    (every rank computed ``wrong`` from the same all-gathered sizes)."""
    if wrong:
        shown = "; ".join(wrong[:4]) + (f"; and {len(wrong) - 4} more" if len(wrong) > 4 else "")
        raise CollectiveMismatchError(f"{op}: sizes disagree across ranks: {shown}", details)


def _agreed_gather_block(comm: Issuer, numel: int, sizes: list[int]) -> int:
    """The largest block of an uneven list all_gather, after every rank checked that each rank's input
    has the size every rank's output tensor for it has (one small all_gather of the sizes).

    Raises:
        CollectiveMismatchError: they differ, on every rank alike, naming each pair.
    """
    size = comm.size
    every = comm.comm.all_gather(torch.tensor([numel, *sizes], dtype=torch.int64)).view(size, 1 + size).tolist()
    wrong = [
        f"rank {i} gives {every[i][0]} elements, rank {j} expects {every[j][1 + i]}"
        for i in range(size)
        for j in range(size)
        if every[j][1 + i] != every[i][0]
    ]
    details = {r: {"op": "all_gather", "input_numel": every[r][0], "output_numels": every[r][1:]} for r in range(size)}
    _raise_on_disagreement("all_gather", wrong, details)
    return int(max(rank[0] for rank in every))


def _agreed_widest_block(comm: Issuer, in_splits: list[int], out_splits: list[int]) -> int:
    """The largest block any rank sends, after every rank checked that what each rank sends each other
    rank is what that rank expects (one small all_gather of every rank's split sizes).

    Raises:
        CollectiveMismatchError: some rank sends another more or fewer rows than it expects, on every
            rank alike (so none goes on to the exchange); it names each such pair. Without this check
            the receiver silently kept the first rows of a longer block, or padding of a shorter one.
    """
    size = comm.size
    mine = torch.tensor(in_splits + out_splits, dtype=torch.int64)
    every = comm.comm.all_gather(mine).view(size, 2, size).tolist()  # [rank][in|out][peer]
    wrong = [
        f"rank {i} sends {every[i][0][j]} rows to rank {j}, which expects {every[j][1][i]}"
        for i in range(size)
        for j in range(size)
        if every[i][0][j] != every[j][1][i]
    ]
    details = {r: {"op": "all_to_all_single", "input_split_sizes": every[r][0], "output_split_sizes": every[r][1]}
               for r in range(size)}  # fmt: skip
    _raise_on_disagreement("all_to_all_single", wrong, details)
    return int(max(max(row) for rank in every for row in rank))


def all_to_all_list(comm: Issuer, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Parts:
    size = comm.size
    if len(outputs) != size or len(inputs) != size:
        raise ValueError(f"all_to_all: needs {size} input and {size} output tensors")
    in_rows = [t.numel() for t in inputs]
    out_rows = [t.numel() for t in outputs]
    joined_in = torch.cat([_flat(t) for t in inputs])
    joined_out = outputs[0].new_empty(sum(out_rows))
    calls, _, finish_single = all_to_all_single(comm, joined_out, joined_in, out_rows, in_rows)

    def finish(results: list[Any]) -> None:
        if finish_single is not None:
            finish_single(results)
        offset = 0
        for out in outputs:
            out.detach().copy_(joined_out[offset : offset + out.numel()].view(out.shape))
            offset += out.numel()

    return calls, list(outputs), finish
