"""``mindspore.nn.Cell``: calling a cell runs its ``construct``."""

from __future__ import annotations

from typing import Any


class Cell:
    """MindSpore's base cell: ``cell(*inputs)`` is ``cell.construct(*inputs)`` (run eagerly)."""

    def __init__(self, auto_prefix: bool = True, flags: Any = None) -> None:
        self.training = False

    def construct(self, *inputs: Any, **kwargs: Any) -> Any:
        """The cell's computation; subclasses define it."""
        raise NotImplementedError(f"{type(self).__name__} defines no construct()")

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.construct(*inputs, **kwargs)

    def set_train(self, mode: bool = True) -> Cell:
        self.training = mode
        return self
