"""nnabla's names for distributed training, on collsvc: ``communicators``, ``ext_utils`` and a minimal
numpy-backed ``NdArray``/``Variable`` with a parameter registry.

Follows seed 000 (nnabla's Communicator API) and seed 001 (its data-parallel tutorial): a script keeps
its calls and changes only its imports::

    import collsvc.compat.nnabla as nn
    import collsvc.compat.nnabla.communicators as C
    from collsvc.compat.nnabla.ext_utils import get_extension_context

Left out, and why: nnabla's graph engine (``nnabla.functions``, ``parametric_functions``, solvers,
``loss.backward(communicator_callbacks=...)``) is nnabla itself, not its communication; a script
without nnabla computes its gradients itself (``Variable.g``) and calls the object
``all_reduce_callback`` returns with each gradient as it becomes ready. Where nnabla is installed its
own ``NdArray`` and ``Variable`` work with the communicator too (through their ``.data`` numpy view).
The multi-device single-process ``DataParallelCommunicator`` is left out: collsvc runs one process
per device.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

__all__ = [
    "NdArray",
    "Variable",
    "clear_parameters",
    "context_scope",
    "get_current_context",
    "get_parameter_or_create",
    "get_parameters",
    "parameter_scope",
    "set_default_context",
    "set_parameter",
]


def _shape_of(args: Sequence[Any]) -> tuple[int, ...]:
    # nnabla takes a shape tuple; its docs also write ``nn.Variable(10, 10)``: accept both.
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return tuple(int(n) for n in args[0])
    return tuple(int(n) for n in args)


class NdArray:
    """A numpy-backed stand-in for ``nnabla.NdArray``: ``.data`` is the numpy array itself, so what a
    collective writes there is what the caller reads.

    Args:
        shape: the array's shape (a tuple, or the sizes as separate arguments).
        dtype: numpy dtype, float32 by default (nnabla's).
    """

    def __init__(self, *shape: Any, dtype: Any = np.float32) -> None:
        self._data = np.zeros(_shape_of(shape), dtype=dtype)

    @classmethod
    def from_numpy_array(cls, array: Any) -> NdArray:
        """An NdArray holding a copy of ``array``."""
        result = cls(())
        result._data = np.array(array)
        return result

    @property
    def data(self) -> np.ndarray[Any, Any]:
        """The values, as the numpy array collectives read and write."""
        return self._data

    @data.setter
    def data(self, value: Any) -> None:
        self._data[...] = value

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._data.shape)

    @property
    def size(self) -> int:
        return int(self._data.size)

    @property
    def dtype(self) -> Any:
        return self._data.dtype

    def zero(self) -> None:
        """Sets every element to 0."""
        self._data[...] = 0

    def fill(self, value: float) -> None:
        """Sets every element to ``value``."""
        self._data[...] = value

    def __repr__(self) -> str:
        return f"<NdArray({self.shape}) of dtype {self.dtype}>"


class Variable:
    """A numpy-backed stand-in for ``nnabla.Variable``: values ``.data``/``.d`` and gradient ``.grad``/``.g``.

    Args:
        shape: the shape (a tuple, or the sizes as separate arguments).
        need_grad: whether a solver updates it.
    """

    def __init__(self, *shape: Any, need_grad: bool = False) -> None:
        self.data = NdArray(_shape_of(shape))
        self.grad = NdArray(_shape_of(shape))
        self.need_grad = need_grad

    @classmethod
    def from_numpy_array(cls, data: Any, grad: Any = None, need_grad: bool = False) -> Variable:
        """A Variable holding a copy of ``data`` (and of ``grad`` when given)."""
        array = np.asarray(data)
        result = cls(array.shape, need_grad=need_grad)
        result.data = NdArray.from_numpy_array(array)
        result.grad = NdArray.from_numpy_array(np.zeros_like(array) if grad is None else grad)
        return result

    @property
    def d(self) -> np.ndarray[Any, Any]:
        """The values as a numpy array (assigning copies into it)."""
        return self.data.data

    @d.setter
    def d(self, value: Any) -> None:
        self.data.data = value

    @property
    def g(self) -> np.ndarray[Any, Any]:
        """The gradient as a numpy array (assigning copies into it)."""
        return self.grad.data

    @g.setter
    def g(self, value: Any) -> None:
        self.grad.data = value

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def size(self) -> int:
        return self.data.size

    def __repr__(self) -> str:
        return f"<Variable({self.shape}, need_grad={self.need_grad})>"


_parameters: OrderedDict[str, Variable] = OrderedDict()
_scope: list[str] = []
_context: list[Any] = [None]


def _full_name(name: str) -> str:
    return "/".join([*_scope, name])


@contextlib.contextmanager
def parameter_scope(name: str) -> Iterator[None]:
    """Parameters created inside are named ``name/...``, as nnabla's ``parameter_scope``."""
    _scope.append(name)
    try:
        yield
    finally:
        _scope.pop()


def get_parameter_or_create(
    name: str,
    shape: Sequence[int] = (),
    initializer: Callable[[tuple[int, ...]], Any] | Any = None,
    need_grad: bool = True,
) -> Variable:
    """The registered parameter ``name`` (under the current scope), created when missing.

    Args:
        initializer: a callable taking the shape, or an array; zeros when None.
    """
    key = _full_name(name)
    found = _parameters.get(key)
    if found is None:
        shape = tuple(shape)
        if initializer is None:
            values: Any = np.zeros(shape, dtype=np.float32)
        elif callable(initializer):
            values = initializer(shape)
        else:
            values = initializer
        found = Variable.from_numpy_array(np.asarray(values, dtype=np.float32).reshape(shape), need_grad=need_grad)
        _parameters[key] = found
    return found


def set_parameter(name: str, variable: Variable) -> None:
    """Registers ``variable`` as parameter ``name`` (under the current scope)."""
    _parameters[_full_name(name)] = variable


def get_parameters(grad_only: bool = True) -> OrderedDict[str, Variable]:
    """The registered parameters by name, in creation order (only those with ``need_grad`` by default)."""
    return OrderedDict((k, v) for k, v in _parameters.items() if v.need_grad or not grad_only)


def clear_parameters() -> None:
    """Forgets every registered parameter."""
    _parameters.clear()


def set_default_context(ctx: Any) -> None:
    """Records ``ctx`` as the default context (arrays here are numpy whatever it names)."""
    _context[0] = ctx


def get_current_context() -> Any:
    """The context last set by :func:`set_default_context` or :func:`context_scope`."""
    return _context[-1]


@contextlib.contextmanager
def context_scope(ctx: Any) -> Iterator[None]:
    """Makes ``ctx`` the current context inside the block."""
    _context.append(ctx)
    try:
        yield
    finally:
        _context.pop()
