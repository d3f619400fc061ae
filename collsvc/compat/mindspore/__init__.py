"""MindSpore's collective primitives (seed 003) on collsvc, numpy-backed.

Mirrors the module paths seed 003's examples import, so they run with only ``mindspore`` replaced by
``collsvc.compat.mindspore``::

    from collsvc.compat.mindspore.communication import init, get_rank
    from collsvc.compat.mindspore import Tensor, context
    import collsvc.compat.mindspore.nn as nn
    import collsvc.compat.mindspore.ops as ops

``communication`` (``init``, ``release``, ``get_rank``, ``get_group_size``, ``get_local_rank``,
``create_group`` ...; ``"nccl_world_group"``, ``"hccl_world_group"`` and ``"mccl_world_group"`` all mean
the world), ``ops`` (``ReduceOp``, ``AllReduce``, ``AllGather``, ``ReduceScatter``, ``Broadcast`` taking and
returning a tuple, ``AlltoAll``, ``NeighborExchange``), ``nn.Cell``, ``Tensor`` and
``context.set_context``. Where MindSpore is installed, its own ``Tensor`` goes into the primitives
and comes out of them (PyNative mode).

Left out, and why: graph compilation (``GRAPH_MODE`` is accepted; cells run eagerly, which gives the
same results for these primitives), devices (arrays stay on the host: there is no MindSpore device
runtime here), and MindSpore's operator library beyond collectives. Errors are collsvc's.
"""

from __future__ import annotations

from collsvc.compat.mindspore import context
from collsvc.compat.mindspore._tensor import (
    Tensor,
    bool_,
    float16,
    float32,
    float64,
    int8,
    int16,
    int32,
    int64,
    uint8,
)

__all__ = [
    "Tensor",
    "bool_",
    "context",
    "float16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
]
