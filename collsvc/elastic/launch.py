"""``collsvc run --min-ranks M --max-restarts K``: supervision of an elastic job's local ranks.

A rank that fails does not stop the others. While restarts are left (K in total for this launcher) a
replacement process is started in its place: it joins a stand-in job of its own through ``collsvc.init()``
and ``collsvc.elastic.run`` then admits it into the running job (``COLLSVC_ELASTIC_JOIN``). With no
restarts left the job goes on with fewer ranks, and fails once fewer than M ranks remain: the other
ranks are stopped and one summary line says so. The job succeeds when its ranks end with exit code 0.

This module imports only the standard library and the launcher, so ``collsvc run`` starts its ranks
as early as ever.
"""

from __future__ import annotations

import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time

from collsvc._output import LinePump
from collsvc._parent_watch import wrap_command
from collsvc.failure_report import REPORT_DIR_ENV
from collsvc.launcher import (
    _AFTER_KILL_WAIT,
    EXIT_TIMEOUT,
    Launcher,
    LaunchSpec,
    _Rank,
    describe_exit,
    rank_env,
)

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
    """A :class:`~collsvc.launcher.Launcher` that keeps the job going when ranks fail.

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

    def run(self, coordinator: str, token: str | None) -> int:
        """See :meth:`Launcher.run`; failed ranks are replaced or dropped instead of stopping the job."""
        self._coordinator, self._token = coordinator, token
        return super().run(coordinator, token)

    def _label(self, entry: _Rank) -> str:
        return self._labels.get(entry.rank, f"rank {entry.rank}")

    def _start_replacement(self, failed: _Rank) -> _Rank:
        """Starts a newcomer in place of ``failed`` (same local rank; the job admits it at a commit).

        Raises:
            OSError: the process could not be started.
        """
        self._restarts += 1
        local_rank = (failed.rank - self.spec.node_rank * self.spec.nproc) % self.spec.nproc
        env = rank_env(os.environ, self.spec, self._coordinator, self._token, local_rank)
        env.update(newcomer_env(self.spec.job_id))
        if self._report_dir is not None:
            env[REPORT_DIR_ENV] = self._report_dir
        process = subprocess.Popen(
            wrap_command(self.spec.command, os.getpid()),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert process.stdout is not None and process.stderr is not None
        ident = self.spec.nnodes * self.spec.nproc + len(self._labels)
        self._labels[ident] = f"replacement {self._restarts}"
        prefix = f"[replacement {self._restarts}] "
        pumps = (LinePump(process.stdout, sys.stdout, prefix), LinePump(process.stderr, sys.stderr, prefix))
        for pump in pumps:
            pump.start()
        entry = _Rank(ident, process, pumps)
        self._ranks.append(entry)
        threading.Thread(
            target=self._wait_one, args=(ident, process), name=f"collsvc-wait {ident}", daemon=True
        ).start()
        return entry

    def _supervise(self) -> int:
        running = {entry.rank: entry for entry in self._ranks}
        failures: list[_Rank] = []
        finished_ok = 0
        below_min: _Rank | None = None
        left_then = 0  # ranks still running when the job fell below --min-ranks
        stopped_by: int | None = None
        timed_out = False
        job_deadline = time.monotonic() + self.spec.timeout if self.spec.timeout else None
        kill_deadline: float | None = None
        give_up: float | None = None
        stopping = False  # the launcher is stopping every rank: exits from now on are not failures

        def begin_stop() -> None:
            nonlocal kill_deadline, stopping
            if kill_deadline is None and give_up is None:
                stopping = True
                self._signal_all(signal.SIGTERM)
                kill_deadline = time.monotonic() + self.spec.grace

        if self._signalled:
            stopped_by = self._signalled
            begin_stop()
        while running:
            deadlines = [d for d in (job_deadline, kill_deadline, give_up) if d is not None]
            wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            try:
                kind, ident, value = self._events.get(timeout=wait)
            except queue.Empty:
                now = time.monotonic()
                if give_up is not None and now >= give_up:
                    break
                if kill_deadline is not None and now >= kill_deadline:
                    self._signal_all(signal.SIGKILL)
                    kill_deadline, give_up = None, now + _AFTER_KILL_WAIT
                if job_deadline is not None and now >= job_deadline:
                    job_deadline = None
                    timed_out = stopped_by is None and below_min is None
                    begin_stop()
                continue
            if kind == "signal":
                stopped_by = stopped_by or value
                if kill_deadline is not None:
                    kill_deadline = time.monotonic()
                begin_stop()
                continue
            entry = running.pop(ident)
            entry.returncode = value
            if stopping:
                continue
            if value == 0:
                finished_ok += 1
                continue
            failures.append(entry)
            self._say(f"collsvc run: {self._label(entry)} on host {self.host} failed: {describe_exit(value)}")
            if self._restarts < self.spec.max_restarts and not finished_ok:
                try:
                    replacement = self._start_replacement(entry)
                except OSError as exc:
                    self._say(f"collsvc run: cannot start a replacement for {self._label(entry)}: {exc}")
                else:
                    running[replacement.rank] = replacement
                    continue
            if len(running) < self.min_ranks and not finished_ok:
                below_min, left_then = entry, len(running)
                begin_stop()
        self._drain_output()
        return self._elastic_summary(failures, below_min, stopped_by, timed_out, left_then)

    def _elastic_summary(
        self, failures: list[_Rank], below_min: _Rank | None, stopped_by: int | None, timed_out: bool, left: int
    ) -> int:
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
        if timed_out:
            self._say(f"collsvc run: the job ran longer than --timeout {self.spec.timeout:g} s; stopped its ranks")
            return EXIT_TIMEOUT
        if failures:
            self._say(
                f"collsvc run: elastic job finished on host {self.host} despite {len(failures)} failed "
                f"process(es) ({failed}); {self._restarts} replacement(s) started"
            )
        return 0
