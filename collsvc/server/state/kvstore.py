"""A job's key/value store (NCCL unique ids, peer addresses, user rendezvous data), with size limits."""

from __future__ import annotations

from collsvc.errors import ResourceLimitError
from collsvc.options import Limits

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


class KVStore:
    """Keys are text, values bytes. Counters (``add``) are stored as decimal ASCII, like torch's store.

    Sizes are checked before anything is stored; waiting for a key is the caller's business (the
    servicer waits on an event that it sets after every write of that key).
    """

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._data: dict[str, bytes] = {}

    def __len__(self) -> int:
        return len(self._data)

    def _check_key(self, key: str) -> None:
        if not key:
            raise ValueError("key must not be empty")
        size = len(key.encode("utf-8"))
        if size > self._limits.max_key_bytes:
            raise ResourceLimitError(f"key of {size} bytes exceeds the limit of {self._limits.max_key_bytes} bytes")

    def _check_value(self, key: str, value: bytes) -> None:
        if len(value) > self._limits.max_value_bytes:
            raise ResourceLimitError(
                f"value of {len(value)} bytes for key {key!r} exceeds the limit of {self._limits.max_value_bytes} bytes"
            )

    def _check_room(self, key: str) -> None:
        if key not in self._data and len(self._data) >= self._limits.max_keys_per_job:
            raise ResourceLimitError(f"the job already holds the maximum of {self._limits.max_keys_per_job} keys")

    def set(self, key: str, value: bytes) -> None:
        """Stores ``value`` under ``key``.

        Raises:
            ValueError: empty key.
            ResourceLimitError: key, value or key count over the limits.
        """
        self._check_key(key)
        self._check_value(key, value)
        self._check_room(key)
        self._data[key] = bytes(value)

    def restore(self, key: str, value: bytes) -> None:
        """Stores ``value`` a member wrote before the coordinator restarted, unless ``key`` holds one
        already: then a decimal counter keeps the larger of the two, anything else the stored value.

        Raises:
            ValueError, ResourceLimitError: as :meth:`set`.
        """
        current = self.get(key)
        if current is None:
            self.set(key, value)
            return
        try:
            if int(value.decode("ascii")) > int(current.decode("ascii")):
                self.set(key, value)
        except (UnicodeDecodeError, ValueError):
            return  # not both counters: the first restored value stays

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or None."""
        self._check_key(key)
        return self._data.get(key)

    def add(self, key: str, amount: int) -> int:
        """Adds ``amount`` to the counter at ``key`` (absent counts as 0) and returns the new value.

        Raises:
            ValueError: the stored value is not a decimal integer, or the result leaves int64.
        """
        self._check_key(key)
        current = self._data.get(key)
        if current is None:
            self._check_room(key)
            base = 0
        else:
            try:
                base = int(current.decode("ascii"))
            except (UnicodeDecodeError, ValueError):
                raise ValueError(f"key {key!r} does not hold a decimal integer counter") from None
        value = base + amount
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError(f"counter {key!r} would overflow int64 ({base} + {amount})")
        self._data[key] = str(value).encode("ascii")
        return value

    def compare_set(self, key: str, *, expect_absent: bool, expected: bytes, desired: bytes) -> tuple[bool, bytes]:
        """Sets ``key`` to ``desired`` when it is absent (``expect_absent``) or equals ``expected``.

        Returns:
            ``(swapped, value)``: whether it swapped, and the value now stored (b"" when absent).
        """
        self._check_key(key)
        self._check_value(key, desired)
        current = self._data.get(key)
        matches = current is None if expect_absent else current == expected
        if not matches:
            return False, current if current is not None else b""
        self._check_room(key)
        self._data[key] = bytes(desired)
        return True, self._data[key]

    def delete(self, key: str) -> bool:
        """Removes ``key``; returns whether it existed."""
        self._check_key(key)
        return self._data.pop(key, None) is not None
