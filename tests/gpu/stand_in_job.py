"""A one-rank job on the NCCL backend through the stand-in (``fake_cupy.install()``), run as its own
process by ``tests/unit/test_nccl_fake.py``: the Communicator's GPU paths end to end without a GPU.
Prints one JSON line with what it saw."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gpu import fake_cupy  # noqa: E402


def main() -> None:
    cp = fake_cupy.install()
    import numpy as np

    import collsvc
    from collsvc.client import ops
    from collsvc.errors import CollectiveTimeoutError
    from collsvc.options import CoordinatorOptions
    from collsvc.server.app import CoordinatorThread

    general = [0]
    planned = ops.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        general[0] += 1
        return planned(*args, **kwargs)

    ops.all_reduce = counted  # the Communicator plans through ops.all_reduce on the general path only
    seen: dict[str, Any] = {}
    with CoordinatorThread(CoordinatorOptions(host="127.0.0.1", port=0, token="t")) as thread:
        comm = collsvc.init(coordinator=thread.address, world_size=1, rank=0, backend="nccl", token="t", timeout=2.0)
        seen["backend"] = comm.backend
        x = cp.asarray(np.arange(8, dtype=np.float32))
        for _ in range(5):
            assert comm.all_reduce(x, out=x) is x
        seen["general_in_place"] = general[0]
        fresh = [comm.all_reduce(x) for _ in range(3)]
        seen["new_arrays"] = [type(f).__module__ == "cupy" and f is not x for f in fresh]
        seen["general_after_new"] = general[0]
        y = comm.all_reduce(cp.asarray(np.ones(4, np.float32)), collsvc.ReduceOp.MAX)
        seen["general_after_other_signature"] = general[0]
        seen["values"] = [np.asarray(x).tolist(), np.asarray(y).tolist()]
        comm.all_reduce(x, out=x, async_op=True).wait()
        comm.synchronize()
        gate = fake_cupy.hold()
        started = time.monotonic()
        work = comm.all_reduce(x, async_op=True)
        comm.all_reduce(x, out=x)  # queued behind the stuck one: returns at once too
        seen["returned_in_s"] = time.monotonic() - started
        for name, wait in (("synchronize", comm.synchronize), ("work_wait", work.wait)):
            try:
                wait()
                seen[name] = "returned"
            except CollectiveTimeoutError as exc:
                seen[name] = type(exc).__name__
        try:
            comm.all_reduce(x, out=x)
        except CollectiveTimeoutError as exc:
            seen["next_call"] = str(exc)
        seen["job_failure"] = type(comm.job.failure).__name__
        gate.release()
        collsvc.destroy()
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
