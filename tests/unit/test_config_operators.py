"""collsvc.init in the pods of Kubernetes training operators: Kubeflow Trainer's ``PET_*`` variables and
Volcano's ``VC_*`` ones, after the other launcher families and before ``JOB_COMPLETION_INDEX``."""

from __future__ import annotations

import pytest

from collsvc.config import resolve_init
from collsvc.launcher_env import operator_launch
from collsvc.options import InitOptions


def resolve(env: dict[str, str]) -> InitOptions:
    return resolve_init(None, None, None, "auto", 30.0, None, None, env)


TRAINER = {"PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"}


@pytest.mark.parametrize(
    "env, expected",
    [
        # One process per pod: the pod's node rank is the rank, also where JobSet's index is set.
        ({**TRAINER, "JOB_COMPLETION_INDEX": "2"}, ("job-node-0-0.job:29400", 3, 2)),
        ({**TRAINER, "PET_NPROC_PER_NODE": "1"}, ("job-node-0-0.job:29400", 3, 2)),
        # Two processes per pod, each knowing its local rank: node rank x 2 + local rank.
        ({**TRAINER, "PET_NPROC_PER_NODE": "2", "LOCAL_RANK": "1"}, ("job-node-0-0.job:29400", 6, 5)),
        # Two per pod, local rank unknown: the coordinator assigns it, never the pod's index.
        ({**TRAINER, "PET_NPROC_PER_NODE": "2", "JOB_COMPLETION_INDEX": "2"}, ("job-node-0-0.job:29400", 6, None)),
        # No port: collsvc's default.
        ({"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "m"}, ("m:29400", 2, 0)),
        # torchrun's own variables (set by torchrun under the Trainer) win, and so do ours.
        ({**TRAINER, "WORLD_SIZE": "4", "RANK": "1", "MASTER_ADDR": "t", "MASTER_PORT": "1"}, ("t:1", 4, 1)),
        ({**TRAINER, "COLLSVC_COORDINATOR": "c:7"}, ("c:7", 3, 2)),
        # Volcano: the worker task's size and this pod's index in it; the coordinator task's first host.
        (
            {"VC_TASK_INDEX": "1", "VC_WORKER_NUM": "4", "VC_WORKER_HOSTS": "j-worker-0.j,j-worker-1.j",
             "VC_COORDINATOR_NUM": "1", "VC_COORDINATOR_HOSTS": "j-coordinator-0.j"},
            ("j-coordinator-0.j:29400", 4, 1),
        ),
        # The only task besides the coordinator, under another name; COLLSVC_COORDINATOR given.
        ({"VC_TASK_INDEX": "0", "VC_TRAINER_NUM": "2", "COLLSVC_COORDINATOR": "c:1"}, ("c:1", 2, 0)),
        (
            {"VC_TASK_INDEX": "1", "VC_A_NUM": "2", "VC_B_NUM": "3", "COLLSVC_VOLCANO_TASK": "b",
             "COLLSVC_COORDINATOR": "c:1"},
            ("c:1", 3, 1),
        ),
    ],
)  # fmt: skip
def test_operator_environments(env: dict[str, str], expected: tuple[object, ...]) -> None:
    o = resolve(env)
    assert (o.coordinator, o.world_size, o.rank) == expected


def test_no_operator_leaves_the_indexed_job_rank() -> None:
    assert operator_launch({"JOB_COMPLETION_INDEX": "1"}) == (None, None, None)
    o = resolve({"COLLSVC_COORDINATOR": "c:1", "COLLSVC_WORLD_SIZE": "2", "JOB_COMPLETION_INDEX": "1"})
    assert (o.world_size, o.rank) == (2, 1)


def test_operator_errors_name_the_variable() -> None:
    with pytest.raises(ValueError, match="PET_NPROC_PER_NODE='auto' is not an integer"):
        resolve({**TRAINER, "PET_NPROC_PER_NODE": "auto"})
    with pytest.raises(ValueError, match="COLLSVC_VOLCANO_TASK"):
        resolve({"VC_TASK_INDEX": "0", "VC_A_NUM": "2", "VC_B_NUM": "2", "COLLSVC_COORDINATOR": "c:1"})
    with pytest.raises(ValueError, match="outside"):
        resolve({**TRAINER, "PET_NODE_RANK": "3"})
