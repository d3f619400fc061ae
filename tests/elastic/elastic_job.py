"""An elastic training script for the tests, run under ``collsvc run``; configured by the environment.

Full-batch gradient descent on a linear least-squares problem whose batch for each step is fixed: each
rank takes the rows ``rank::size`` of it and the gradients are summed with all_reduce, so the weights
depend only on the steps taken, not on the membership (up to floating-point summation order).

Environment:
    ELASTIC_STEPS: steps to train (default 40); ELASTIC_COMMIT_EVERY: steps between commits (default 5).
    ELASTIC_OUT: directory each process writes ``final-<pid>.json`` to when its training returns.
    ELASTIC_KILLS: ``step:rank,...``: from that step on, as soon as at least two ranks are left, the process
        that is that rank (modulo the size) SIGKILLs itself; the training goes on until every kill happened.
        Each kill happens once per job: a marker file in ELASTIC_OUT makes a replayed step skip it.
    ELASTIC_DIE_IN_REFORM: ``generation:member``: that member of the previous generation SIGKILLs itself
        right after announcing itself alive for that generation (a death during the re-form).
    ELASTIC_GROW_TO: after ELASTIC_STEPS, go on training until the membership has this many ranks
        again (replacements admitted), for at most MAX_STEPS steps in all.
    ELASTIC_TORCH: "1" adds a torch tensor and a torch module's state dict to the state.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

import numpy as np

import collsvc

DIM = 6
BATCH = 24
LEARNING_RATE = 0.02
MAX_STEPS = 100_000  # a job that never grows back fails here instead of running forever


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((BATCH, DIM))
    y = x @ np.arange(1.0, DIM + 1.0)
    return x, y


def reference(steps: int) -> np.ndarray:
    """The weights of the same training without any failure, computed in one process."""
    w = np.zeros(DIM)
    for step in range(steps):
        x, y = batch(step)
        w = w - LEARNING_RATE * (x.T @ (x @ w - y)) / BATCH
    return w


def _kill_once(marker: str) -> None:
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # this death already happened; the step is being replayed after the rollback
    os.kill(os.getpid(), signal.SIGKILL)


class _DieInReform(logging.Handler):
    """SIGKILLs this process when the re-form logs that ``member`` is alive for ``generation``."""

    def __init__(self, generation: int, member: int) -> None:
        super().__init__()
        self.target = (generation, member)

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.endswith("is alive") and tuple(record.args or ())[1:] == self.target:  # type: ignore[index]
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    steps = int(os.environ.get("ELASTIC_STEPS", "40"))
    commit_every = int(os.environ.get("ELASTIC_COMMIT_EVERY", "5"))
    grow_to = int(os.environ.get("ELASTIC_GROW_TO", "0"))
    out = os.environ["ELASTIC_OUT"]
    kills = []  # (from step, victim rank, marker file), in step order
    for index, entry in enumerate(filter(None, os.environ.get("ELASTIC_KILLS", "").split(","))):
        step, rank = entry.split(":")
        kills.append((int(step), int(rank), os.path.join(out, f"killed-{index}")))
    die = os.environ.get("ELASTIC_DIE_IN_REFORM")
    if die:
        generation, member = die.split(":")
        logger = logging.getLogger("collsvc.elastic.membership")
        logger.setLevel(logging.INFO)
        logger.addHandler(_DieInReform(int(generation), int(member)))

    if os.environ.get("ELASTIC_VERBOSE") == "1":
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    collsvc.init()
    values: dict[str, object] = {"step": 0, "w": np.zeros(DIM), "log": []}
    if os.environ.get("ELASTIC_TORCH") == "1":
        import torch

        values["t"] = torch.zeros(DIM, dtype=torch.float32)
        values["module"] = torch.nn.Linear(2, 2).state_dict()
    state = collsvc.elastic.State(**values)

    @collsvc.elastic.run
    def train(comm: collsvc.Communicator, state: collsvc.elastic.State) -> collsvc.Communicator:
        # At most one kill per membership: the first one not yet done when this membership began, agreed
        # by every member (MIN) before anyone can kill. Two kills at once could take every state holder.
        first_pending = next((i for i, k in enumerate(kills) if not os.path.exists(k[2])), len(kills))
        agreed = int(comm.all_reduce(np.array([first_pending]), collsvc.MIN)[0])
        kill = kills[agreed] if agreed < len(kills) else None

        def more_to_do() -> bool:
            if state.step >= MAX_STEPS:
                return False
            pending_kills = any(not os.path.exists(marker) for _, _, marker in kills)
            return state.step < steps or comm.size < grow_to or pending_kills

        while more_to_do():
            if kill is not None and kill[0] <= state.step and comm.size >= 2 and kill[1] % comm.size == comm.rank:
                _kill_once(kill[2])
            x, y = batch(state.step)
            rows = slice(comm.rank, None, comm.size)
            gradient = x[rows].T @ (x[rows] @ state.w - y[rows])
            total = comm.all_reduce(gradient)
            state.w -= LEARNING_RATE * total / BATCH
            if "t" in state.as_dict():
                state.t += comm.all_reduce(state.t.new_ones(DIM))
                for tensor in state.module.values():
                    tensor += 1.0
            state.step += 1
            if state.step % commit_every == 0:
                state.log.append(comm.size)
                state.commit()
        return comm

    comm = train(state)  # a newcomer the job never admitted exits 0 in there, writing nothing
    result: dict[str, object] = {"pid": os.getpid(), "admitted": True}
    result.update(rank=comm.rank, size=comm.size, step=state.step, w=state.w.tolist(), sizes=state.log)
    if "t" in state.as_dict():
        result["t"] = state.t.tolist()
        result["module"] = {k: v.tolist() for k, v in state.module.items()}
    with open(os.path.join(out, f"final-{os.getpid()}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    print(f"finished: {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
