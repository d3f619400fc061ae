"""collsvc errors as torch users catch them: each also a ``torch.distributed.DistBackendError``.

torch code catches ``DistBackendError`` (or ``RuntimeError``) around collectives; collsvc code catches
``RankFailedError`` and friends. The error a torch user sees is both: for every collsvc error class a
subclass of it and of ``DistBackendError``, and the instance carries the original's attributes
(``ranks``, ``waiting_on``, ``details`` ...) and chains it as ``__cause__``.

These errors travel: torch pickles a Future's error to look for tensors in it (DDP's reducer and every
``then`` callback do), and ``torch.multiprocessing`` sends errors between processes. So the classes of
collsvc's own errors are defined here, by name (``collsvc.torch._errors.RankFailedError`` ...), and
every torch-facing error pickles as "rebuild the torch-facing class of this collsvc class, with these
args and attributes" (the ``__cause__`` chain stays behind, as pickle leaves every exception's).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar, cast

import torch.distributed as dist

from collsvc import errors

F = TypeVar("F", bound=Callable[..., Any])

_lock = threading.Lock()
_torch_classes: dict[type[errors.CollsvcError], type[errors.CollsvcError]] = {}


def _rebuild(cls: type[errors.CollsvcError], args: tuple[Any, ...], state: dict[str, Any]) -> errors.CollsvcError:
    """The torch-facing error of collsvc class ``cls`` with ``args`` and attributes ``state`` (unpickling)."""
    built = torch_error_class(cls)
    error = built.__new__(built)
    error.args = args
    error.__dict__.update(state)
    return error


class _TorchFacing:
    """Pickles a torch-facing error by its collsvc class (which pickle finds by name), args and attributes."""

    def __reduce__(self) -> tuple[Any, ...]:
        error = cast(errors.CollsvcError, self)
        base = next(c for c in type(self).__mro__ if c not in _FACING and issubclass(c, errors.CollsvcError))
        return (_rebuild, (base, error.args, dict(error.__dict__)))


def _define(cls: type[errors.CollsvcError], module: str) -> type[errors.CollsvcError]:
    namespace = {"__module__": module, "__doc__": cls.__doc__, "__qualname__": cls.__name__}
    return cast(type[errors.CollsvcError], type(cls.__name__, (_TorchFacing, cls, dist.DistBackendError), namespace))


_FACING: set[type] = set()  # the torch-facing classes (and their mixin), skipped when finding the collsvc class
_FACING.add(_TorchFacing)


def torch_error_class(cls: type[errors.CollsvcError]) -> type[errors.CollsvcError]:
    """The class that is both ``cls`` and ``torch.distributed.DistBackendError`` (built once per class;
    collsvc's own are named in this module: ``collsvc.torch._errors.RankFailedError`` ...)."""
    if issubclass(cls, dist.DistBackendError):
        return cls
    with _lock:
        built = _torch_classes.get(cls)
        if built is None:
            built = _define(cls, __name__)
            _torch_classes[cls] = built
            _FACING.add(built)
        return built


# collsvc's own error classes, torch-facing, reachable here by name (``collsvc.torch._errors.RankFailedError``).
CollsvcError = torch_error_class(errors.CollsvcError)
JobBrokenError = torch_error_class(errors.JobBrokenError)
RankFailedError = torch_error_class(errors.RankFailedError)
CollectiveMismatchError = torch_error_class(errors.CollectiveMismatchError)
AbortedError = torch_error_class(errors.AbortedError)
CollectiveTimeoutError = torch_error_class(errors.CollectiveTimeoutError)
RendezvousError = torch_error_class(errors.RendezvousError)
AuthenticationError = torch_error_class(errors.AuthenticationError)
BackendUnavailableError = torch_error_class(errors.BackendUnavailableError)
ResourceLimitError = torch_error_class(errors.ResourceLimitError)
JobEndedError = torch_error_class(errors.JobEndedError)
ForkedChildError = torch_error_class(errors.ForkedChildError)


def to_torch_error(error: errors.CollsvcError) -> errors.CollsvcError:
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


def raise_for_torch(error: errors.CollsvcError) -> NoReturn:
    """Raises ``error`` as its torch-facing error (:func:`to_torch_error`), chained to it.

    Raises:
        CollsvcError: always; also a ``DistBackendError``.
    """
    converted = to_torch_error(error)
    if converted is error:
        raise error
    raise converted from error


def missed_monitored_barrier(
    error: errors.CollsvcError, milliseconds: int, wait_all_ranks: bool
) -> errors.CollsvcError:
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
        except errors.CollsvcError as exc:
            raise_for_torch(exc)

    return cast(F, wrapper)
