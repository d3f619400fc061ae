"""The numpy views the torch backend hands the Communicator for CPU tensors (collsvc/torch/_host_arrays.py)
and how it tells a call its caller waits for (``caller_waits``, ``waited_sum_view``): pure functions, no ranks."""

from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402

from collsvc.torch._host_arrays import host_array  # noqa: E402
from collsvc.torch._issuing import caller_waits, waited_sum_view  # noqa: E402


def _address(view: np.ndarray) -> int:
    return int(view.__array_interface__["data"][0])


def test_a_held_tensor_gets_its_kept_view_until_its_memory_or_layout_changes() -> None:
    t = torch.ones(16)
    first = host_array(t, held=True)
    assert first is not None and host_array(t, held=True) is first
    t.resize_(4096)  # larger: new memory
    moved = host_array(t, held=True)
    assert moved is not first and moved.shape == (4096,) and _address(moved) == t.data_ptr()
    t.set_(torch.full((8,), 2.0))
    assert host_array(t, held=True).tolist() == [2.0] * 8
    t.data = torch.full((8,), 3, dtype=torch.int32)  # same object, another dtype
    view = host_array(t, held=True)
    assert view.dtype == np.int32 and view.tolist() == [3] * 8
    t.as_strided_((4,), (2,))  # not C-contiguous any more: no view, the DLPack way
    assert host_array(t, held=True) is None
    grad = torch.zeros(4, requires_grad=True)  # keyed by the caller's tensor, viewed detached
    assert host_array(grad, held=True) is host_array(grad, held=True)


def test_kept_views_do_not_keep_tensors_alive_and_other_views_do() -> None:
    t = torch.ones(1 << 16)
    host_array(t, held=True)
    gone = weakref.ref(t)
    del t
    gc.collect()
    assert gone() is None
    u = torch.ones(8)
    owning = host_array(u)  # not held: the view may outlive the caller's reference (async calls)
    alive = weakref.ref(u)
    del u
    gc.collect()
    assert alive() is not None and owning is not None and owning.tolist() == [1.0] * 8


def test_caller_waits_follows_the_options_async_flag() -> None:
    opts = dist.AllreduceOptions()
    assert caller_waits(opts) is False  # torch's default (what C++ callers such as DDP pass)
    opts.asyncOp = False
    assert caller_waits(opts) is True
    assert caller_waits(None) is False  # no options and no torch.distributed caller: asynchronous


def _options(async_op: bool, op: object = None) -> object:
    opts = dist.AllreduceOptions()
    opts.asyncOp = async_op
    if op is not None:
        opts.reduceOp = op
    return opts


def test_only_a_waited_sum_of_one_dense_cpu_tensor_takes_the_straight_way() -> None:
    t = torch.ones(8)
    view = waited_sum_view([t], _options(False))
    assert view is not None and _address(view) == t.data_ptr()
    assert waited_sum_view([t], _options(False)) is view  # the kept view, as for any held call
    assert waited_sum_view([t], _options(True)) is None  # async_op=True, and DDP's reducer from C++
    assert waited_sum_view([t], _options(False, dist.ReduceOp.AVG)) is None
    assert waited_sum_view([t], _options(False, dist.ReduceOp.MAX)) is None
    assert waited_sum_view([t, torch.ones(8)], _options(False)) is None  # several tensors: fused
    assert waited_sum_view([t], None) is None
    assert waited_sum_view([torch.ones(4, 4).t()], _options(False)) is None  # not C-contiguous
    assert waited_sum_view([torch.ones(8, dtype=torch.bfloat16)], _options(False)) is None  # numpy lacks it
