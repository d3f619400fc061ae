"""Bagua's gradient algorithms for ``model.with_bagua([optimizer], algorithm)``."""

from __future__ import annotations

from collsvc.compat.bagua.algorithms.base import Algorithm
from collsvc.compat.bagua.algorithms.bytegrad import ByteGradAlgorithm
from collsvc.compat.bagua.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

__all__ = ["Algorithm", "ByteGradAlgorithm", "GradientAllReduceAlgorithm"]
