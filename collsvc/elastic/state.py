"""``collsvc.elastic.State``: the training state an elastic job carries across membership changes.

A State holds named values as attributes: numpy arrays, torch tensors, dicts of them (a module's or an
optimizer's ``state_dict()``), lists of them, and any picklable value. ``commit()`` keeps an in-memory
copy, the restore point; after a member fails every survivor goes back to it, and the lowest surviving
rank's copy is broadcast to every member of the new membership, newcomers included.

Arrays are restored and received in place when the shape and dtype still match, so references the
training code holds (an optimizer's parameters, say) stay valid.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from collsvc.client.communicator import Communicator


def _is_torch_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach") and hasattr(value, "clone")


def _is_array(value: Any) -> bool:
    return isinstance(value, np.ndarray) or _is_torch_tensor(value)


def _snapshot(value: Any) -> Any:
    """A copy of ``value`` that later changes to ``value`` cannot reach (arrays copied, not shared)."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if _is_torch_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return type(value)((key, _snapshot(item)) for key, item in value.items())
    if isinstance(value, list):
        return [_snapshot(item) for item in value]
    return copy.deepcopy(value)


def _copy_into(target: Any, source: Any) -> bool:
    """Copies array ``source`` into array ``target`` in place; False when kinds, shapes or dtypes differ."""
    if isinstance(target, np.ndarray) and isinstance(source, np.ndarray):
        if target.shape != source.shape or target.dtype != source.dtype or not target.flags.writeable:
            return False
        np.copyto(target, source)
        return True
    if _is_torch_tensor(target) and _is_torch_tensor(source):
        if tuple(target.shape) != tuple(source.shape) or target.dtype != source.dtype:
            return False
        target.detach().copy_(source)  # detach: a leaf that requires grad cannot be written in place
        return True
    return False


def _restore(current: Any, saved: Any) -> Any:
    """The value to hold after going back to ``saved``: ``current`` refilled in place where possible."""
    if _is_array(saved):
        return current if _copy_into(current, saved) else _snapshot(saved)
    if isinstance(saved, dict) and isinstance(current, dict):
        restored = {
            key: _restore(current[key], item) if key in current else _snapshot(item) for key, item in saved.items()
        }
        current.clear()
        current.update(restored)
        return current
    if isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
        current[:] = [_restore(old, item) for old, item in zip(current, saved, strict=True)]
        return current
    return _snapshot(saved)


@dataclasses.dataclass(frozen=True)
class _ArraySlot:
    """Stands for the array at position ``index`` of a broadcast: what receivers allocate."""

    index: int
    kind: str  # "numpy" or "torch"
    shape: tuple[int, ...]
    dtype: str


def _split(value: Any, arrays: list[Any]) -> Any:
    """``value`` with each array replaced by an :class:`_ArraySlot`; the arrays go to ``arrays``."""
    if _is_array(value):
        arrays.append(value)
        kind = "numpy" if isinstance(value, np.ndarray) else "torch"
        dtype = str(value.dtype).removeprefix("torch.")
        return _ArraySlot(len(arrays) - 1, kind, tuple(int(n) for n in value.shape), dtype)
    if isinstance(value, dict):
        return type(value)((key, _split(item, arrays)) for key, item in value.items())
    if isinstance(value, list):
        return [_split(item, arrays) for item in value]
    return value


def _receive_buffer(slot: _ArraySlot, local: Any) -> Any:
    """Where to receive ``slot``: the local array when it matches, else a new one."""
    if local is not None and _is_array(local):
        kind = "numpy" if isinstance(local, np.ndarray) else "torch"
        dtype = str(local.dtype).removeprefix("torch.")
        matches = (kind, tuple(int(n) for n in local.shape), dtype) == (slot.kind, slot.shape, slot.dtype)
        writable = local.is_contiguous() if kind == "torch" else local.flags.c_contiguous and local.flags.writeable
        if matches and writable:
            return local
    if slot.kind == "torch":
        import torch

        return torch.empty(slot.shape, dtype=getattr(torch, slot.dtype))
    return np.empty(slot.shape, dtype=np.dtype(slot.dtype))


def _local_arrays(skeleton: Any, local: Any, found: dict[int, Any]) -> None:
    """Maps each slot index of ``skeleton`` to the array at the same place in ``local`` (if any)."""
    if isinstance(skeleton, _ArraySlot):
        found[skeleton.index] = local
    elif isinstance(skeleton, dict) and isinstance(local, dict):
        for key, item in skeleton.items():
            if key in local:
                _local_arrays(item, local[key], found)
    elif isinstance(skeleton, list) and isinstance(local, list) and len(skeleton) == len(local):
        for item, old in zip(skeleton, local, strict=True):
            _local_arrays(item, old, found)


def _fill(skeleton: Any, arrays: list[Any]) -> Any:
    if isinstance(skeleton, _ArraySlot):
        return arrays[skeleton.index]
    if isinstance(skeleton, dict):
        return type(skeleton)((key, _fill(item, arrays)) for key, item in skeleton.items())
    if isinstance(skeleton, list):
        return [_fill(item, arrays) for item in skeleton]
    return skeleton


class State:
    """Named training state with an in-memory restore point, for :func:`collsvc.elastic.run`.

    Values are set and read as attributes (``state.step += 1``). Names starting with ``_`` are reserved.

    Args:
        **values: the initial values; arrays (numpy, torch), dicts and lists of them, picklable values.
            The initial values are the first restore point.
    """

    _values: dict[str, Any]
    _saved: dict[str, Any]
    _on_commit: Callable[[], None] | None

    def __init__(self, **values: Any) -> None:
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_saved", _snapshot(self._values))
        object.__setattr__(self, "_on_commit", None)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"elastic State has no value {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            raise AttributeError(f"elastic State names must not start with '_': {name!r}")
        self._values[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self._values[name]
        except KeyError:
            raise AttributeError(f"elastic State has no value {name!r}") from None

    def __repr__(self) -> str:
        return f"State({', '.join(sorted(self._values))})"

    def as_dict(self) -> dict[str, Any]:
        """The current values by name (the State's own objects, not copies)."""
        return dict(self._values)

    def commit(self) -> None:
        """Makes the current values the restore point.

        Inside :func:`collsvc.elastic.run` this is also where newcomers waiting to join are noticed:
        one key/value read on rank 0 and a one-element collective, after which every member re-forms
        together with them (without rolling back: the restore point is the state just committed).

        Raises:
            RankFailedError / CollectiveTimeoutError: a member failed during the check (the enclosing
                :func:`collsvc.elastic.run` handles it like any failed collective).
        """
        object.__setattr__(self, "_saved", _snapshot(self._values))
        if self._on_commit is not None:
            self._on_commit()

    def restore(self) -> None:
        """Goes back to the last commit (arrays refilled in place where their shape and dtype match)."""
        current = self._values
        restored = {
            name: _restore(current[name], saved) if name in current else _snapshot(saved)
            for name, saved in self._saved.items()
        }
        object.__setattr__(self, "_values", restored)

    def broadcast(self, comm: Communicator, src: int = 0) -> None:
        """Replaces every member's values with ``src``'s and makes them the restore point.

        Every rank of ``comm`` calls it. Non-array values travel pickled (``broadcast_object``, so the
        job needs a token, TLS or ``COLLSVC_ALLOW_UNAUTHENTICATED_PICKLE=1``); arrays travel as arrays
        and are received in place where the local array has the same kind, shape and dtype.

        Raises:
            RankFailedError / CollectiveTimeoutError: a member failed or stalled during the broadcast.
            AuthenticationError: the job has neither token nor TLS and pickling was not allowed.
        """
        arrays: list[Any] = []
        skeleton = _split(self._values, arrays) if comm.rank == src else None
        skeleton = comm.broadcast_object(skeleton, src)
        local: dict[int, Any] = {}
        if comm.rank != src:
            _local_arrays(skeleton, self._values, local)
        received: list[Any] = []
        for slot in _slots(skeleton):
            if comm.rank == src:
                array = arrays[slot.index]
                buffer = np.ascontiguousarray(array) if isinstance(array, np.ndarray) else array.detach().contiguous()
                comm.broadcast(buffer, src)
                received.append(array)
            else:
                buffer = _receive_buffer(slot, local.get(slot.index))
                target = buffer.detach() if _is_torch_tensor(buffer) else buffer
                comm.broadcast(target, src, out=target)
                received.append(buffer)
        if comm.rank != src:
            object.__setattr__(self, "_values", dict(_fill(skeleton, received)))
        object.__setattr__(self, "_saved", _snapshot(self._values))


def _slots(skeleton: Any) -> list[_ArraySlot]:
    """Every slot of ``skeleton``, in index order."""
    found: list[_ArraySlot] = []

    def walk(value: Any) -> None:
        if isinstance(value, _ArraySlot):
            found.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(skeleton)
    return sorted(found, key=lambda slot: slot.index)
