"""``python -m collsvc.elastic.rejoin SCRIPT [ARGS...]``: a rank of an elastic job that rejoins when restarted.

Some launchers restart a failed process with the environment it first had: a Kubernetes Indexed Job
replaces a failed pod with a new one of the same completion index (same ``COLLSVC_RANK``, world size
and job id), as do restart policies of systemd or compose. Such a process would wait in
``collsvc.init()`` for a generation 0 that moved on without it. Started through this module, it asks
the coordinator first: when the elastic job its environment names already started, the script runs
as a newcomer (a stand-in job of its own and ``COLLSVC_ELASTIC_JOIN``, as the replacements of
``collsvc run --max-restarts`` do), and the members admit it at their next ``state.commit()``.
Otherwise the script runs unchanged, as one of the job's first members.

The rest of the command line goes to the Python interpreter, which replaces this process: ``SCRIPT
[ARGS]``, ``-m MODULE [ARGS]`` or ``-c CODE``.

The job id must name one run of the job (a Kubernetes Job's uid does): an elastic job's keys stay
on the coordinator after it finished, so a new run under an old id would be taken for a restart.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from collsvc.config import resolve_init
from collsvc.elastic.launch import JOIN_ENV, newcomer_env
from collsvc.elastic.membership import started
from collsvc.errors import CollsvcError

USAGE = "usage: python -m collsvc.elastic.rejoin SCRIPT [ARGS...] | -m MODULE [ARGS...] | -c CODE\n"
INIT_TIMEOUT = 300.0  # collsvc.init()'s default, which the script's own init would wait as long


def environment_for(env: Mapping[str, str]) -> tuple[dict[str, str], bool]:
    """The environment to run the script with, and whether it makes the script a newcomer.

    Args:
        env: the environment the launcher gave this process.

    Raises:
        ValueError: ``env`` names no coordinator or world size, or holds a bad value (see
            ``collsvc.config``).
        RendezvousError: the coordinator did not answer within the join timeout.
        AuthenticationError: the coordinator refused the token.
    """
    if env.get(JOIN_ENV):
        return dict(env), True  # already a newcomer (a replacement that collsvc run started)
    options = resolve_init(None, None, None, "auto", INIT_TIMEOUT, None, None, env)
    if not started(options):
        return dict(env), False
    return {**env, **newcomer_env(options.job_id)}, True


def main(argv: list[str] | None = None) -> int:
    """Runs the interpreter on ``argv`` with the environment :func:`environment_for` chose.

    Returns:
        2 for a bad command line or environment, 1 when the coordinator could not be asked; on success
        it does not return (the interpreter replaces this process).
    """
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        sys.stderr.write(USAGE)
        return 0 if args else 2
    try:
        env, newcomer = environment_for(os.environ)  # the script's environment is a copy of this one
    except ValueError as exc:
        sys.stderr.write(f"collsvc.elastic.rejoin: {exc}\n")
        return 2
    except CollsvcError as exc:
        sys.stderr.write(f"collsvc.elastic.rejoin: cannot ask the coordinator: {type(exc).__name__}: {exc}\n")
        return 1
    if newcomer and not os.environ.get(JOIN_ENV):  # reads the environment itself: the elastic launcher's own handshake
        sys.stderr.write(
            f"collsvc.elastic.rejoin: elastic job {env[JOIN_ENV]!r} already runs; "
            "joining it as a newcomer (admitted at the members' next state.commit())\n"
        )
    sys.stderr.flush()
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *args], env)


if __name__ == "__main__":
    sys.exit(main())
