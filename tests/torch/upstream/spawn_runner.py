"""torch's own distributed test suite (torch/testing/_internal/distributed/distributed_test.py) run the
way torch's test/distributed/test_distributed_spawn.py runs it for gloo, here for BACKEND=collsvc.

Env (as upstream): BACKEND, WORLD_SIZE, TEMP_DIR (holding a ``barrier`` directory), INIT_METHOD
(optional, default env://). Not collected by pytest on its own (no ``test_`` prefix):
tests/torch/test_upstream_suite.py runs it in a subprocess.

An out-of-tree backend joins torch's feature table the way the torch_ucc plugin's spawn test does:
listed in the "plugin", "ddp" and "subgroup" sets (CPU only, not "gpu"/"cuda") before
distributed_test is imported, because its decorators read the sets at import time. Spawned ranks
re-import this module to unpickle the test class, so each imports collsvc.torch before it creates
its process group.
"""

import os

import torch
from torch.testing._internal.common_distributed import DistTestCases

if os.environ["BACKEND"] == "collsvc":
    import collsvc.torch  # noqa: F401  registers the backend, in this process and in each spawned rank

    for feature in ("plugin", "ddp", "subgroup"):
        DistTestCases.backend_feature[feature] = set(DistTestCases.backend_feature[feature]) | {"collsvc"}

from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc]
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()
