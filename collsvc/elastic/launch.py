"""``collsvc run --min-ranks M --max-restarts K``: supervision of an elastic job's local ranks.

A rank that fails does not stop the others. While restarts are left (K in total for this launcher) a
replacement process is started in its place: it joins a stand-in job of its own through ``collsvc.init()``
and ``collsvc.elastic.run`` then admits it into the running job (``COLLSVC_ELASTIC_JOIN``). With no
restarts left the job goes on with fewer ranks, and fails once fewer than M ranks remain: the other
ranks are stopped and one summary line says so. The job succeeds when its ranks end with exit code 0.

This module imports only the standard library and the launcher's own modules, so ``collsvc run``
starts its ranks as early as ever.
"""

from __future__ import annotations

import os
import secrets
import signal

from collsvc.launch.launcher import EXIT_TIMEOUT, Launcher
from collsvc.launch.rank_processes import RankProcess, Supervision, describe_exit
from collsvc.launch.spec import LaunchSpec, rank_env

JOIN_ENV = "COLLSVC_ELASTIC_JOIN"  # the same name collsvc.elastic.membership reads


def newcomer_env(job_id: str) -> dict[str, str]:
    """The variables that make a process a newcomer of the elastic job ``job_id``.

    ``collsvc.init()`` then joins a stand-in job of its own (world size 1, a random job id), and
    ``collsvc.elastic.run`` waits in ``job_id``'s lobby until the members admit it at a commit.
    """
    return {
        "COLLSVC_WORLD_SIZE": "1",
        "COLLSVC_RANK": "0",
        "COLLSVC_JOB_ID": f"{job_id}@newcomer-{secrets.token_hex(6)}",
        JOIN_ENV: job_id,
    }


class ElasticLauncher(Launcher):
    """A :class:`~collsvc.launch.launcher.Launcher` that keeps the job going when ranks fail.

    ``--min-ranks`` defaults to every rank of this launcher when only ``--max-restarts`` is given: then
    a failure with no restart left stops the job, as without elastic supervision. Both count the ranks
    of this launcher (this node).
    """

    def __init__(self, spec: LaunchSpec, **kwargs: object) -> None:
        super().__init__(spec, **kwargs)  # type: ignore[arg-type]
        self.min_ranks = spec.min_ranks if spec.min_ranks is not None else spec.nproc
        self._restarts = 0
        self._coordinator = ""
        self._token: str | None = None
        self._labels: dict[int, str] = {}
        self._failures: list[RankProcess] = []  # processes that exited non-zero, in order
        self._finished_ok = 0
        self._left_then = 0  # ranks still running when the job fell below --min-ranks

    def run(self, coordinator: str, token: str | None) -> int:
        """See :meth:`Launcher.run`; failed ranks are replaced or dropped instead of stopping the job."""
        self._coordinator, self._token = coordinator, token
        return super().run(coordinator, token)

    def _label(self, entry: RankProcess) -> str:
        return self._labels.get(entry.rank, f"rank {entry.rank}")

    def _start_replacement(self, failed: RankProcess) -> RankProcess:
        """Starts a newcomer in place of ``failed`` (same local rank; the job admits it at a commit).

        Raises:
            OSError: the process could not be started.
        """
        self._restarts += 1
        local_rank = (failed.rank - self.spec.node_rank * self.spec.nproc) % self.spec.nproc
        # reads the environment itself: a replacement's starts as a copy of the launcher's (rank_env)
        env = rank_env(os.environ, self.spec, self._coordinator, self._token, local_rank)
        env.update(newcomer_env(self.spec.job_id))
        ident = self.spec.nnodes * self.spec.nproc + len(self._labels)
        label = f"replacement {self._restarts}"
        entry = self._start_process(ident, label, env)
        self._labels[ident] = label
        return entry

    def _on_exit(self, run: Supervision, entry: RankProcess) -> None:
        """A failed rank is replaced while restarts are left, else dropped; below --min-ranks the job stops."""
        if run.stopping:  # the launcher is stopping every rank: exits from now on are not failures
            return
        if entry.returncode == 0:
            self._finished_ok += 1
            return
        self._failures.append(entry)
        self._say(
            f"collsvc run: {self._label(entry)} on host {self.host} failed: {describe_exit(entry.returncode or 0)}"
        )
        if self._restarts < self.spec.max_restarts and not self._finished_ok:
            try:
                replacement = self._start_replacement(entry)
            except OSError as exc:
                self._say(f"collsvc run: cannot start a replacement for {self._label(entry)}: {exc}")
            else:
                run.running[replacement.rank] = replacement
                return
        if len(run.running) < self.min_ranks and not self._finished_ok:
            run.failed, self._left_then = entry, len(run.running)
            self._begin_stop(run)

    def _summarize(self, run: Supervision) -> int:
        below_min, stopped_by, left, failures = run.failed, run.stopped_by, self._left_then, self._failures
        failed = ", ".join(f"{self._label(e)} ({describe_exit(e.returncode or 0)})" for e in failures)
        if below_min is not None:
            self._say(
                f"collsvc run: elastic job failed on host {self.host}: {left} rank(s) left, fewer "
                f"than --min-ranks {self.min_ranks}; failed: {failed}; {self._restarts} of "
                f"{self.spec.max_restarts} restart(s) used"
            )
            code = below_min.returncode or 1
            return code if code > 0 else 128 - code
        if stopped_by is not None:
            self._say(
                f"collsvc run: interrupted by {signal.Signals(stopped_by).name}; stopped the ranks on host {self.host}"
            )
            return 128 + stopped_by
        if run.timed_out:
            self._say(f"collsvc run: the job ran longer than --timeout {self.spec.timeout:g} s; stopped its ranks")
            return EXIT_TIMEOUT
        if failures:
            self._say(
                f"collsvc run: elastic job finished on host {self.host} despite {len(failures)} failed "
                f"process(es) ({failed}); {self._restarts} replacement(s) started"
            )
        return 0
