"""collsvc errors as torch users catch them: each also a ``torch.distributed.DistBackendError``.

torch code catches ``DistBackendError`` (or ``RuntimeError``) around collectives; collsvc code catches
``RankFailedError`` and friends. The error a torch user sees is both: for every collsvc error class a
subclass of it and of ``DistBackendError`` is built once, and the instance carries the original's
attributes (``ranks``, ``waiting_on``, ``details`` ...) and chains it as ``__cause__``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar, cast

import torch.distributed as dist

from collsvc.errors import CollsvcError

F = TypeVar("F", bound=Callable[..., Any])

_lock = threading.Lock()
_torch_classes: dict[type[CollsvcError], type[CollsvcError]] = {}


def torch_error_class(cls: type[CollsvcError]) -> type[CollsvcError]:
    """The class that is both ``cls`` and ``torch.distributed.DistBackendError`` (built once per class)."""
    if issubclass(cls, dist.DistBackendError):
        return cls
    with _lock:
        built = _torch_classes.get(cls)
        if built is None:
            namespace = {"__module__": "collsvc.torch", "__doc__": cls.__doc__, "__qualname__": cls.__name__}
            built = cast(type[CollsvcError], type(cls.__name__, (cls, dist.DistBackendError), namespace))
            _torch_classes[cls] = built
        return built


def to_torch_error(error: CollsvcError) -> CollsvcError:
    """``error`` as an instance of its torch-facing class, with the same message and attributes.

    Returns ``error`` itself when it already is a ``DistBackendError``.
    """
    if isinstance(error, dist.DistBackendError):
        return error
    cls = torch_error_class(type(error))
    converted = cls.__new__(cls)
    converted.args = error.args
    converted.__dict__.update(error.__dict__)
    converted.__cause__ = error
    converted.__traceback__ = error.__traceback__
    return converted


def raise_for_torch(error: CollsvcError) -> NoReturn:
    """Raises ``error`` as its torch-facing error (:func:`to_torch_error`), chained to it.

    Raises:
        CollsvcError: always; also a ``DistBackendError``.
    """
    converted = to_torch_error(error)
    if converted is error:
        raise error
    raise converted from error


def missed_monitored_barrier(error: CollsvcError, milliseconds: int, wait_all_ranks: bool) -> CollsvcError:
    """``error`` (a monitored barrier's) retold the way gloo's ``monitoredBarrier`` words it, so that torch
    code matching gloo's message keeps working: "Rank 2 failed to pass monitoredBarrier in 1000 ms"
    (with ``wait_all_ranks``: "Ranks 1, 2 failed ..."), then collsvc's own message. Same class and
    attributes; ``error`` unchanged when it names no rank (``ranks``)."""
    ranks = list(getattr(error, "ranks", ()))
    if not ranks:
        return error
    ms = f"to pass monitoredBarrier in {milliseconds} ms"
    if wait_all_ranks:
        lead = f"Ranks {', '.join(str(r) for r in ranks)} failed {ms}"
    else:  # gloo names the first; collsvc names the others too
        lead = f"Rank {ranks[0]} failed {ms}"
        if len(ranks) > 1:
            lead += f" (so did ranks {', '.join(str(r) for r in ranks[1:])})"
    retold = type(error).__new__(type(error))
    retold.__dict__.update(error.__dict__)
    retold.args = (f"{lead}:\n{error}", *error.args[1:])
    return retold


def translated(fn: F, run: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any] | None = None) -> F:
    """Decorates a method so that collsvc errors it raises leave it as torch-facing errors; ``run(fn, args,
    kwargs)``, when given, calls it (in the same frame: process-group methods run on every collective)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs) if run is None else run(fn, args, kwargs)
        except CollsvcError as exc:
            raise_for_torch(exc)

    return cast(F, wrapper)
