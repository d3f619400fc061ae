"""What the launcher that started this process says in its environment.

Every launcher family ``collsvc.init`` accepts names the coordinator, the world size, this process's rank
and its local rank in variables of its own; first match wins, in the order of the tuples below (see
``collsvc/config.py`` for the whole list). Kubernetes training operators (Kubeflow Trainer, Volcano) are
read by :func:`operator_launch`, and Open MPI's one-host job without a coordinator by
:func:`mpirun_local_job`. With ``collsvc/config.py`` (which reads collsvc's own knobs and merges
everything into ``InitOptions``), the only module that reads the environment.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping

DEFAULT_PORT = 29400

COORDINATOR_VARS = ("COLLSVC_COORDINATOR", "MASTER_ADDR+MASTER_PORT")
WORLD_SIZE_VARS = ("COLLSVC_WORLD_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", "PMI_SIZE")
RANK_VARS = (
    "COLLSVC_RANK",
    "RANK",
    "OMPI_COMM_WORLD_RANK",
    "SLURM_PROCID",
    "PMI_RANK",
    "JOB_COMPLETION_INDEX",  # last: resolve_init consults the operators' variables (operator_launch) before it
)
LOCAL_RANK_VARS = ("COLLSVC_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")


def first_of(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            return name, str(value)
    return None


def int_from(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    found = first_of(env, names)
    if found is None:
        return None
    name, value = found
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def coordinator_from_env(env: Mapping[str, str]) -> str | None:
    """``host:port`` of the coordinator from the environment, or None."""
    if env.get("COLLSVC_COORDINATOR"):
        return env["COLLSVC_COORDINATOR"]
    if env.get("MASTER_ADDR"):
        return f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT') or DEFAULT_PORT}"
    return None


def operator_launch(env: Mapping[str, str]) -> tuple[str | None, int | None, int | None]:
    """(coordinator, world size, rank) from a Kubernetes training operator's environment; None where it
    sets none. Consulted after the launcher families above and before ``JOB_COMPLETION_INDEX``.

    Kubeflow Trainer: ``PET_NNODES`` pods of ``PET_NPROC_PER_NODE`` processes (default 1) each, this pod
    being ``PET_NODE_RANK``; the rank is ``PET_NODE_RANK * PET_NPROC_PER_NODE + local rank`` where the
    local rank is known (``COLLSVC_LOCAL_RANK``/``LOCAL_RANK``, or 0 with one process per pod), else
    left to the coordinator; the coordinator is ``PET_MASTER_ADDR:PET_MASTER_PORT``.

    Volcano (its ``env`` and ``svc`` plugins): ``VC_TASK_INDEX`` is the rank within the task whose size
    ``VC_<TASK>_NUM`` is the world size. The task is ``COLLSVC_VOLCANO_TASK`` (default: ``worker``, or
    the job's only task other than ``coordinator``); the coordinator is the first host of
    ``VC_COORDINATOR_HOSTS`` on port 29400, when the job has a task named ``coordinator``.

    Raises:
        ValueError: a variable is not an integer (``PET_NPROC_PER_NODE=auto`` included: collsvc needs
            the count), or the Volcano task cannot be told.
    """
    if env.get("PET_NNODES"):
        nodes = int_from(env, ("PET_NNODES",)) or 0
        per_node = int_from(env, ("PET_NPROC_PER_NODE",)) or 1
        node = int_from(env, ("PET_NODE_RANK",))
        local = int_from(env, LOCAL_RANK_VARS)
        if local is None and per_node == 1:
            local = 0
        rank = None if node is None or local is None else node * per_node + local
        master = env.get("PET_MASTER_ADDR")
        coordinator = f"{master}:{env.get('PET_MASTER_PORT') or DEFAULT_PORT}" if master else None
        return coordinator, nodes * per_node, rank
    if env.get("VC_TASK_INDEX"):
        tasks = sorted(name[3:-4] for name in env if name.startswith("VC_") and name.endswith("_NUM") and len(name) > 7)
        task = env.get("COLLSVC_VOLCANO_TASK", "").upper().replace("-", "_")
        if not task:
            others = [t for t in tasks if t != "COORDINATOR"]
            task = "WORKER" if "WORKER" in tasks else (others[0] if len(others) == 1 else "")
        if not task or f"VC_{task}_NUM" not in env:
            raise ValueError(
                f"Volcano job with tasks {', '.join(tasks) or '(none named)'}: set COLLSVC_VOLCANO_TASK to the "
                "task whose pods are the ranks"
            )
        hosts = [h for h in env.get("VC_COORDINATOR_HOSTS", "").split(",") if h]
        coordinator = f"{hosts[0]}:{DEFAULT_PORT}" if hosts else None
        return coordinator, int_from(env, (f"VC_{task}_NUM",)), int_from(env, ("VC_TASK_INDEX",))
    return None, None, None


MPIRUN_HOSTS_ERROR = (
    "mpirun started this job's ranks on more than one host, and no coordinator was given: start one "
    "(`collsvc coordinator --host 0.0.0.0`) and pass its address to every rank, e.g. "
    "`mpirun -x COLLSVC_COORDINATOR=HOST:29400 ...`"
)


def mpirun_local_job(env: Mapping[str, str] | None = None) -> tuple[str, int, str] | None:
    """The Open MPI job this process belongs to, when mpirun started it and names no coordinator.

    Returns:
        ``(key, local_rank, folder)``: a name unique to the mpirun job (its job id and the address of
        mpirun itself), this process's rank on its host, and the folder where local rank 0 publishes
        the coordinator it starts (mpirun's own session folder, removed when mpirun ends, else the
        temp folder). None when a coordinator is set or the process was not started by Open MPI's
        mpirun.

    Raises:
        ValueError: the job's ranks span hosts (``OMPI_COMM_WORLD_LOCAL_SIZE`` below
            ``OMPI_COMM_WORLD_SIZE``): they cannot find a coordinator one of them starts.
    """
    env = os.environ if env is None else env
    if coordinator_from_env(env) or not env.get("OMPI_COMM_WORLD_SIZE"):
        return None
    job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE") or ""
    mpirun = env.get("OMPI_MCA_orte_hnp_uri") or env.get("PMIX_SERVER_URI41") or env.get("PMIX_SERVER_URI4") or ""
    if not job and not mpirun:
        return None
    size = int_from(env, ("OMPI_COMM_WORLD_SIZE",)) or 1
    local_size = int_from(env, ("OMPI_COMM_WORLD_LOCAL_SIZE",)) or size
    if local_size != size:
        raise ValueError(MPIRUN_HOSTS_ERROR)
    import hashlib

    key = hashlib.sha256(f"{job}|{mpirun}".encode()).hexdigest()[:16]
    folder = env.get("OMPI_MCA_orte_jobfam_session_dir") or env.get("PMIX_SERVER_TMPDIR") or tempfile.gettempdir()
    return key, int_from(env, ("OMPI_COMM_WORLD_LOCAL_RANK",)) or 0, folder
