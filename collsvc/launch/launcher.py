"""``collsvc run``: start N local ranks of a script, copy their output, stop them all at the first failure.

With no ``coordinator`` the launcher serves an embedded coordinator (``embedded_coordinator``) on a free
port of ``127.0.0.1`` with a fresh random token, in a thread of its own process, started while the ranks
start; otherwise the ranks join the given one (multi-node: one launcher per node, each its ``node_rank``).

Each rank runs in its own session (process group), so stopping a rank also stops the processes it
started. When the first rank exits non-zero or is killed, every other rank gets SIGTERM, then SIGKILL
after ``grace`` seconds; the launcher prints one summary line naming that rank and exits non-zero.
SIGINT / SIGTERM to the launcher are forwarded the same way.
"""

from __future__ import annotations

import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from collsvc.config import COORDINATOR_READY_ENV, host_name, thread_defaults
from collsvc.launch.embedded_coordinator import EmbeddedCoordinator
from collsvc.launch.fork_server import script_preloads
from collsvc.launch.forked_ranks import ForkedProcess, ForkServer, can_fork, signal_group
from collsvc.launch.join_relay import JoinRelay, start_relay
from collsvc.launch.output import LinePump, write_line
from collsvc.launch.parent_watch import wrap_command
from collsvc.launch.rank_processes import RankProcess, Supervision, describe_exit
from collsvc.launch.spec import FORK_SERVER, LaunchSpec, rank_env
from collsvc.observability.failure_report import REPORT_DIR_ENV, failure_summary, read_reports

EXIT_TIMEOUT = 124  # like coreutils timeout(1)
# Ranks per core that keep the default heartbeat pace (1 s, failed after 5 s of silence). Past it, the
# ranks, the launcher and its embedded coordinator share too little CPU to send and read every
# heartbeat in time (measured on 2 cores, docs/operations.md), so the pace slows in proportion.
RANKS_PER_CORE_AT_DEFAULT_PACE = 8
DEFAULT_HEARTBEAT_INTERVAL = 1.0
DEFAULT_HEARTBEAT_TIMEOUT = 5.0


def embedded_pace(nproc: int, cores: int, timeout: float | None = None) -> tuple[float, float]:
    """(heartbeat interval, heartbeat timeout) in seconds for the embedded coordinator of ``nproc``
    ranks on ``cores`` cores: the defaults up to :data:`RANKS_PER_CORE_AT_DEFAULT_PACE` ranks per core,
    proportionally slower above. ``timeout`` (``--heartbeat-timeout``) overrides the timeout; the
    interval is then a fifth of it, at most the scaled one.
    """
    scale = max(1.0, nproc / (max(cores, 1) * RANKS_PER_CORE_AT_DEFAULT_PACE))
    interval, scaled_timeout = DEFAULT_HEARTBEAT_INTERVAL * scale, DEFAULT_HEARTBEAT_TIMEOUT * scale
    if timeout is None:
        return interval, scaled_timeout
    return min(interval, max(timeout / 5, 0.01)), timeout


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


_AFTER_KILL_WAIT = 5.0  # seconds to wait for SIGKILLed ranks to be reaped before giving up on them
_PUMP_JOIN = 2.0  # seconds to let the output copiers drain after the ranks exited


class Launcher:
    """Starts and supervises the local ranks of one ``collsvc run``.

    Args:
        spec: what to start.
        host: the host name used in the summary line.
        out: where a summary line goes (default ``sys.stderr``).
    """

    def __init__(self, spec: LaunchSpec, *, host: str | None = None, out: Callable[[str], None] | None = None):
        self.spec = spec
        self.host = host or host_name()
        self._say = out or (lambda text: write_line(sys.stderr, text + "\n"))
        self._events: queue.SimpleQueue[tuple[str, int, int]] = queue.SimpleQueue()
        self._ranks: list[RankProcess] = []
        self._signalled: int | None = None
        self._failed_order: list[int] = []  # ranks that exited non-zero, in the order they did
        self._failed_unstopped: set[int] = set()  # ... not because the launcher stopped them
        self._signals_sent: set[int] = set()  # signals the launcher sent its ranks
        self._report_dir: str | None = None  # where ranks write why they failed (failure_report)
        self.embedded: EmbeddedCoordinator | None = None  # started once the ranks are (see launch)
        self.heartbeat_interval: float | None = None  # the embedded coordinator's pace, given to the ranks
        self._relay: JoinRelay | None = None  # joins the ranks in one call (see run)
        self._fork_server: ForkServer | None = None  # started with the first rank (see _spawn)

    # -- signals ---------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread between bytecodes; SimpleQueue.put is reentrant, a Queue would not be.
        self._signalled = self._signalled or signum
        self._events.put(("signal", -1, signum))

    def stop_ranks(self) -> None:
        """Stops every rank as a SIGTERM to the launcher does (callable from any thread)."""
        self._on_signal(signal.SIGTERM, None)

    def _install_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous: dict[int, Any] = {}
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[signum] = signal.signal(signum, self._on_signal)
        return previous

    # -- processes -------------------------------------------------------------------------------

    def _spawn(self, coordinator: str, token: str | None) -> None:
        for local_rank in range(self.spec.nproc):
            if self._signalled:
                return
            rank = self.spec.node_rank * self.spec.nproc + local_rank
            # reads the environment itself: each rank's starts as a copy of the launcher's (rank_env)
            env = rank_env(os.environ, self.spec, coordinator, token, local_rank)
            ready = self.embedded.ready_signal if self.embedded is not None else None
            if ready is not None:  # the ranks wait for it (see collsvc/launch/embedded_coordinator.py)
                env[COORDINATOR_READY_ENV] = ready[1]
            env.update(self._relay.environment() if self._relay is not None else {})
            if self.heartbeat_interval is not None and not env.get("COLLSVC_HEARTBEAT_INTERVAL"):  # the user's wins
                env["COLLSVC_HEARTBEAT_INTERVAL"] = f"{self.heartbeat_interval:g}"
            pass_fds = (ready[0],) if ready is not None else ()
            if self._fork_server is None and self.spec.start_method == FORK_SERVER and can_fork(self.spec.command):
                self._fork_server = ForkServer(env, pass_fds, script_preloads(self.spec.command))
            self._start_process(rank, f"rank {rank}", env, pass_fds)

    def _start_process(
        self, ident: int, label: str, env: dict[str, str], pass_fds: tuple[int, ...] = ()
    ) -> RankProcess:
        """Starts one process of ``spec.command``; its output lines are copied prefixed ``[label]``.

        Raises:
            OSError: the process could not be started.
        """
        if self._report_dir is not None:
            env[REPORT_DIR_ENV] = self._report_dir
        process: ForkedProcess | subprocess.Popen[bytes]
        if self._fork_server is not None:
            process = self._fork_server.start(ident, self.spec.command, env, pass_fds)
        else:
            # The process dies with this one even when it is SIGKILLed (see collsvc/launch/parent_watch.py). Linux
            # ties that to the thread that starts it: this one, which supervises the ranks until they exit
            # (and which starts the fork server, which the forked ranks die with).
            process = subprocess.Popen(
                wrap_command(self.spec.command, os.getpid()),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group: stopping a rank stops its children
                pass_fds=pass_fds,
            )
        assert process.stdout is not None and process.stderr is not None
        prefix = f"[{label}] "
        pumps = (LinePump(process.stdout, sys.stdout, prefix), LinePump(process.stderr, sys.stderr, prefix))
        for pump in pumps:
            pump.start()
        entry = RankProcess(ident, process, pumps)
        self._ranks.append(entry)
        threading.Thread(
            target=self._wait_one, args=(ident, process), name=f"collsvc-wait {label}", daemon=True
        ).start()
        return entry

    def _wait_one(self, rank: int, process: ForkedProcess | subprocess.Popen[bytes]) -> None:
        self._events.put(("exit", rank, process.wait()))

    def _signal_all(self, signum: int) -> None:
        self._signals_sent.add(signum)
        for entry in self._ranks:
            signal_group(entry.process, signum)

    # -- the supervision loop --------------------------------------------------------------------

    def run(self, coordinator: str, token: str | None) -> int:
        """Starts the ranks, waits for all of them, and returns the exit status for ``collsvc run``.

        Args:
            coordinator: ``host:port`` the ranks join.
            token: the job token given to the ranks, or None.

        Returns:
            0 when every rank exited 0; the failed rank's exit code (128 + signal number when it was
            killed by a signal) for the first rank that failed; 128 + signal number when the launcher
            was interrupted; 124 when ``spec.timeout`` expired; 1 when a rank could not be started.
        """
        previous = self._install_handlers()
        self._report_dir = tempfile.mkdtemp(prefix="collsvc-run-reports-")
        self._relay = start_relay(self.spec.nproc, self.spec.elastic, coordinator, token, self._say)
        try:
            try:
                self._spawn(coordinator, token)
                if self.embedded is not None:  # now: its imports would hold up starting the ranks (GIL)
                    self.embedded.start()
            except OSError as exc:
                self._say(f"collsvc run: cannot start rank {len(self._ranks)}: {exc}")
                self._stop_now()
                return 1
            return self._supervise()
        finally:
            if self._fork_server is not None:
                self._fork_server.close()
            if self._relay is not None:
                self._relay.close()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            shutil.rmtree(self._report_dir, ignore_errors=True)

    def _stop_now(self) -> None:
        self._signal_all(signal.SIGKILL)
        for entry in self._ranks:
            entry.process.wait()

    def _supervise(self) -> int:
        job_deadline = time.monotonic() + self.spec.timeout if self.spec.timeout else None
        run = Supervision({entry.rank: entry for entry in self._ranks}, job_deadline)
        if self._signalled:  # a signal came while the ranks were being started
            run.stopped_by = self._signalled
            self._begin_stop(run)
        while run.running:
            entry = self._next_exit(run)
            if entry is None:
                break  # unkillable (uninterruptible sleep): report what we know
            self._on_exit(run, entry)
        self._drain_output()
        return self._summarize(run)

    def _begin_stop(self, run: Supervision) -> None:
        if not run.stopping:
            self._signal_all(signal.SIGTERM)
            run.kill_deadline = time.monotonic() + self.spec.grace

    def _next_exit(self, run: Supervision) -> RankProcess | None:
        """Waits for the next rank to exit, handling signals and deadlines meanwhile.

        Returns:
            The rank that exited (removed from ``run.running``, its ``returncode`` set), or None when
            SIGKILLed ranks did not exit within ``_AFTER_KILL_WAIT`` seconds.
        """
        while True:
            deadlines = [d for d in (run.job_deadline, run.kill_deadline, run.give_up) if d is not None]
            wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            try:
                kind, rank, value = self._events.get(timeout=wait)
            except queue.Empty:
                now = time.monotonic()
                if run.give_up is not None and now >= run.give_up:
                    return None
                if run.kill_deadline is not None and now >= run.kill_deadline:
                    self._signal_all(signal.SIGKILL)
                    run.kill_deadline, run.give_up = None, now + _AFTER_KILL_WAIT
                if run.job_deadline is not None and now >= run.job_deadline:
                    run.job_deadline = None
                    run.timed_out = not run.cause_known
                    self._begin_stop(run)
                continue
            if kind == "exit":
                entry = run.running.pop(rank)
                entry.returncode = value
                return entry
            if not run.cause_known:
                run.stopped_by = value
            if run.kill_deadline is not None:  # a second Ctrl-C: do not wait out the grace period
                run.kill_deadline = time.monotonic()
            self._begin_stop(run)

    def _on_exit(self, run: Supervision, entry: RankProcess) -> None:
        """A rank exited: the first failure stops the job (the elastic launcher replaces this policy)."""
        if entry.returncode:
            self._failed_order.append(entry.rank)
            # Dying of a signal the launcher itself sent is not failing by itself.
            if not any(entry.returncode in (-signum, 128 + signum) for signum in self._signals_sent):
                self._failed_unstopped.add(entry.rank)
            if not run.cause_known:
                run.failed = entry
                self._begin_stop(run)

    def _drain_output(self) -> None:
        # The ranks are gone; their pipes reach EOF unless a stray child still holds them open.
        deadline = time.monotonic() + _PUMP_JOIN
        for entry in self._ranks:
            for pump in entry.pumps:
                pump.join(max(0.0, deadline - time.monotonic()))

    def _summarize(self, run: Supervision) -> int:
        failed, stopped_by = run.failed, run.stopped_by
        if failed is not None and failed.returncode is not None:
            reports = read_reports(self._report_dir) if self._report_dir else {}
            exits = {e.rank: describe_exit(e.returncode) for e in self._ranks if e.returncode is not None}
            order = self._failed_order or [failed.rank]
            self._say(failure_summary(reports, order, self._failed_unstopped, exits, self.host))
            code = failed.returncode
            return code if code > 0 else 128 - code
        if stopped_by is not None:
            name, count = signal.Signals(stopped_by).name, len(self._ranks)
            self._say(f"collsvc run: interrupted by {name}; stopped {count} rank(s) on host {self.host}")
            return 128 + stopped_by
        if run.timed_out:
            self._say(
                f"collsvc run: the job ran longer than --timeout {self.spec.timeout:g} s; "
                f"stopped {len(self._ranks)} rank(s) on host {self.host}"
            )
            return EXIT_TIMEOUT
        return 0


def launch(spec: LaunchSpec, launcher: Launcher | None = None, *, heartbeat_timeout: float | None = None) -> int:
    """Runs ``spec`` to completion, with an embedded coordinator unless ``spec.coordinator`` is set.

    Args:
        spec: what to start.
        launcher: who supervises the ranks (default: a :class:`Launcher`; elastic jobs pass theirs).
        heartbeat_timeout: seconds of silence before the embedded coordinator fails a rank (default:
            5, more for more ranks per core, see :func:`embedded_pace`).

    Returns:
        The exit status of ``collsvc run`` (see :meth:`Launcher.run`); 1 when the embedded coordinator fails.
    """
    launcher = launcher or Launcher(spec)
    if spec.coordinator is not None:
        return merge_timeline(spec, launcher, launcher.run(spec.coordinator, spec.token))
    os.environ.update(thread_defaults(os.environ, spec.nproc))  # here too: the coordinator loads OpenBLAS
    token = secrets.token_urlsafe(32)
    cores = usable_cores()
    interval, timeout = embedded_pace(spec.nproc, cores, heartbeat_timeout)
    if heartbeat_timeout is None and timeout > DEFAULT_HEARTBEAT_TIMEOUT:
        write_line(
            sys.stderr,
            f"collsvc run: {spec.nproc} ranks on {cores} cores: ranks heartbeat every {interval:g} s and one "
            f"silent for {timeout:g} s is failed (more than {RANKS_PER_CORE_AT_DEFAULT_PACE} ranks per core "
            "cannot keep the 5 s default; --heartbeat-timeout sets it)\n",
        )
    launcher.heartbeat_interval = interval
    coordinator = EmbeddedCoordinator(
        token, on_failure=launcher.stop_ranks, heartbeat_interval=interval, heartbeat_timeout=timeout
    )
    address = coordinator.reserve()
    said: list[str] = []  # printed once the coordinator has stopped, after its last log lines
    launcher._say, code = said.append, 1
    try:
        if address is not None:
            launcher.embedded = coordinator  # it starts while the ranks start
            code = merge_timeline(spec, launcher, launcher.run(address, token))
    finally:
        coordinator.stop()
        if coordinator.error is not None:  # the ranks were stopped for it: their summary would mislead
            said, code = [f"collsvc run: {coordinator.failure()}"], 1
        for line in said:
            write_line(sys.stderr, line + "\n")
    return code


def merge_timeline(spec: LaunchSpec, launcher: Launcher, code: int) -> int:
    """After the ranks exited: merges their ``COLLSVC_TIMELINE`` parts (if any); returns ``code``, unchanged."""
    from collsvc.observability.timeline import merge_after_launch

    said = merge_after_launch(several_nodes=spec.nnodes > 1)
    if said:
        launcher._say(f"collsvc run: {said}")
    return code
