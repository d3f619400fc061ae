"""``bagua.torch_api``: the same names as :mod:`collsvc.compat.bagua`."""

from __future__ import annotations

from collsvc.compat.bagua import *  # noqa: F403
from collsvc.compat.bagua import __all__  # noqa: F401
