"""``mindspore.context``: ``set_context``/``get_context`` and the mode constants."""

from __future__ import annotations

from typing import Any

GRAPH_MODE = 0
PYNATIVE_MODE = 1

_settings: dict[str, Any] = {"mode": PYNATIVE_MODE, "device_target": "CPU"}


def set_context(**kwargs: Any) -> None:
    """Records settings (``mode``, ``device_target`` ...). Cells run eagerly whatever the mode: the
    collective primitives give the same results in both."""
    _settings.update(kwargs)


def get_context(attr_key: str) -> Any:
    """A setting recorded by :func:`set_context`.

    Raises:
        ValueError: never set and not a known key.
    """
    if attr_key not in _settings:
        raise ValueError(f"context has no setting {attr_key!r}")
    return _settings[attr_key]
