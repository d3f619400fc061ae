"""CUDA tensors stay ordered on the caller's torch stream through collsvc's CuPy-based data plane.

torch and CuPy each keep their own "current stream" per thread. A torch user who fills a tensor on a
side stream (``with torch.cuda.stream(s): ...``) and hands it to ``dist.all_reduce`` expects the
collective to run after that work and before whatever the stream runs next, as torch's own NCCL
backend does. collsvc's GPU paths order themselves on CuPy's current stream, so each process-group
method makes torch's current stream (of the tensors' device) CuPy's current stream while it issues its
calls; the Communicator carries that stream to its worker thread for asynchronous calls.

Work on CUDA tensors also runs after the calls themselves: results copied into the caller's tensors by
a finisher (on the thread that completed the calls), sends and receives posted on their own threads.
These enter the same stream, and a Work of CUDA tensors is complete only once that stream is: its
Future may complete on another thread and be read there on another stream (DDP's comm hooks), so
"done" must mean the bytes are in place, not merely queued.

Nothing here touches CUDA for CPU tensors: the check is ``torch.cuda.is_initialized()`` first.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch


class _CallerState(threading.local):
    """Per thread: the caller's stream of the process-group method running on it (None: CPU tensors or
    no method). A class default, so reading it when unset costs no failed lookup."""

    stream: CallerStream | None = None


_local = _CallerState()


class CallerStream:
    """The CUDA device and torch stream that were current where a collective was called.

    Args:
        device: the CUDA ordinal of the call's tensors.
        ptr: torch's current stream on that device at the call, as a raw ``cudaStream_t`` (0: the
            legacy default stream).
    """

    __slots__ = ("_cupy_stream", "device", "ptr")

    def __init__(self, device: int, ptr: int) -> None:
        self.device = device
        self.ptr = ptr
        self._cupy_stream: Any = None

    def _cupy(self) -> Any:
        if self._cupy_stream is None:
            import cupy

            self._cupy_stream = cupy.cuda.ExternalStream(self.ptr, self.device)
        return self._cupy_stream

    @contextlib.contextmanager
    def entered_for_cupy(self) -> Iterator[None]:
        """On the caller's own thread (where torch's current stream already is this one): makes this
        device and stream CuPy's current ones for the duration."""
        import cupy

        with cupy.cuda.Device(self.device), self._cupy():
            yield

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """On another thread: makes this device, and this stream as torch's and CuPy's current stream,
        current for the duration (restored afterwards)."""
        if self.ptr == 0:
            stream = torch.cuda.default_stream(self.device)
        else:
            stream = torch.cuda.ExternalStream(self.ptr, device=torch.device("cuda", self.device))  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream), self.entered_for_cupy():
            yield

    def synchronize(self) -> None:
        """Waits until everything queued on the stream so far has run (on any thread: the stream's
        device is made current first, as the legacy default stream, 0, is the current device's)."""
        import cupy

        with cupy.cuda.Device(self.device):
            self._cupy().synchronize()


def _current_raw_stream(device: int) -> int:
    """torch's current stream on ``device`` as a raw pointer (its private getter is ~20x cheaper than
    ``torch.cuda.current_stream``, which a 4 KiB collective would otherwise call several times)."""
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is not None:
        return int(getter(device))
    return int(torch.cuda.current_stream(device).cuda_stream)


def _first_tensor(value: Any, depth: int = 0) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item, depth + 1)
            if found is not None:
                return found
    return None


def caller_stream_of(values: tuple[Any, ...]) -> CallerStream | None:
    """The caller's stream for the first CUDA tensor among ``values`` (tensors, or lists of them, or
    lists of lists); None when CUDA is not initialized or the first tensor found is not a CUDA one."""
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return None  # no CUDA tensor can exist in this process yet
    tensor = _first_tensor(values)
    if tensor is None or not tensor.is_cuda:
        return None
    index = tensor.device.index
    device = int(index) if index is not None else torch.cuda.current_device()
    return CallerStream(device, _current_raw_stream(device))


def current() -> CallerStream | None:
    """The caller's stream of the process-group method running on this thread, if its tensors are CUDA."""
    return _local.stream


def run_on_caller_stream(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)``, a process-group method called with ``args``: while it runs, torch's current
    stream of its tensors' device is CuPy's current stream too, and :func:`current` returns it (for CPU
    tensors, a plain call)."""
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return fn(*args, **kwargs)  # no CUDA tensor can exist in this process yet
    stream = caller_stream_of(args[1:])
    if stream is None:
        return fn(*args, **kwargs)
    previous = current()
    _local.stream = stream
    try:
        with stream.entered_for_cupy():  # torch's current stream is this one already
            return fn(*args, **kwargs)
    finally:
        _local.stream = previous


def run_on(stream: CallerStream | None, fn: Callable[[], Any]) -> Any:
    """``fn()`` on a thread other than the caller's, as if on the caller's: inside ``stream`` (when not
    None), then waits for the stream, so that the result is in place when this returns."""
    if stream is None:
        return fn()
    with stream.entered():
        result = fn()
        stream.synchronize()
    return result
