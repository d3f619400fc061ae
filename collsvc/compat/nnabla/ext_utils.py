"""``nnabla.ext_utils.get_extension_context`` for the communicators of :mod:`collsvc.compat.nnabla`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Context:
    """nnabla's ``Context``: the backends to compute on, the array class and the device id.

    collsvc's nnabla face moves numpy arrays whatever the context says; the communicator accepts
    any context and keeps it.
    """

    backend: list[str] = field(default_factory=lambda: ["cpu:float"])
    array_class: str = "CpuCachedArray"
    device_id: str = "0"


def get_extension_context(
    ext_name: str = "cpu", device_id: str | int = "0", type_config: str = "float", **kw: object
) -> Context:
    """A context for the extension ``ext_name`` (``"cpu"``, ``"cuda"``, ``"cudnn"``, ``"cuda.cudnn"``).

    Args:
        device_id: the device index, as nnabla takes it (a string or an int).
        type_config: ``"float"`` or ``"half"``.

    Raises:
        ValueError: ``ext_name`` is not an extension nnabla has.
    """
    name = ext_name.split(".")[-1]
    if name not in ("cpu", "cuda", "cudnn"):
        raise ValueError(f"unknown nnabla extension {ext_name!r}: expected 'cpu', 'cuda', 'cudnn' or 'cuda.cudnn'")
    if name == "cpu":
        return Context([f"cpu:{type_config}"], "CpuCachedArray", str(device_id))
    return Context([f"{name}:{type_config}", f"cpu:{type_config}"], "CudaCachedArray", str(device_id))
