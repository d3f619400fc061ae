"""What an algorithm does for ``with_bagua``: reduce the gradients before each optimizer step."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from collsvc import Communicator


class Algorithm:
    """Bagua's algorithm interface, reduced to its effect: :meth:`reduce` makes every rank's gradients
    the same combination of all ranks' gradients, in place."""

    def reduce(self, grads: Sequence[torch.Tensor], comm: Communicator) -> None:
        """Combines ``grads`` (this rank's gradients) across ``comm``, in place."""
        raise NotImplementedError


def by_dtype(grads: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The gradients grouped by dtype and device, in order (one bucket each, as Bagua flattens them)."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.dtype, grad.device), []).append(grad)
    return list(groups.values())
