"""The fork server: one process that loads what a rank loads, then forks every rank from itself.

``collsvc run`` starts a Python script's ranks through it (collsvc/launch/forked_ranks.py is the launcher's
side). Four fresh interpreters on two cores spend ~0.4 s starting and importing numpy, gRPC and collsvc
before their scripts run; one interpreter that imports them once and forks four times spends ~0.35 s in
all, and each forked rank starts its script within milliseconds. The launcher starts it through
``collsvc/launch/parent_watch.py``, so it dies with the launcher::

    python -m collsvc.launch.fork_server SOCKET_FD [MODULE ...]

Besides :data:`PRELOADED` it loads the MODULEs the launcher names: the torch modules a script imports at
its top (:func:`script_preloads`), ~2 s of CPU per rank otherwise.

The launcher sends requests over the ``SOCK_SEQPACKET`` socket ``SOCKET_FD``, one JSON object per
message: ``{"start": IDENT, "command": [...], "env": {...}, "keep_fds": [...]}`` with the rank's stdout
and stderr pipes attached (``SCM_RIGHTS``), and ``{"signal": IDENT, "signum": N}``. The server answers
``{"started": IDENT, "pid": PID}`` and, when the rank has ended, ``{"exited": IDENT, "returncode": RC}``
(negative: killed by that signal, as ``subprocess.Popen.returncode``). It exits once the launcher has
closed the socket and every rank it started has ended.

A forked rank is set up the way a fresh interpreter running its command would be: its own session, a
parent-death signal tied to this server (so a dead launcher takes it along), stdin ``/dev/null``, its
pipes as stdout and stderr, its environment, ``sys.argv``, ``sys.path[0]`` and a fresh ``__main__``.
numpy's global random generator is reseeded from the OS, as a fresh interpreter seeds it (Python's
``random`` reseeds itself after a fork). The server itself runs no threads, so forking it is safe; gRPC
creates its threads only once a channel or server exists, which happens in the ranks. gRPC's own fork
handlers are off (``import collsvc`` sets ``GRPC_ENABLE_FORK_SUPPORT=false`` before gRPC loads, see
collsvc/client/fork_guard.py): nothing of gRPC runs at these forks, nor at the ones a rank makes.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import gc
import importlib
import importlib.machinery
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import types
from collections.abc import Sequence
from typing import Any, NoReturn

# What `import collsvc; collsvc.init(); comm.barrier()` loads in a rank (numpy, gRPC, protobuf,
# collsvc's client), measured; a module that fails to load here is loaded, or fails, in the rank.
PRELOADED = (
    "collsvc._api",
    "grpc._channel",
    "grpc._interceptor",
    "grpc._server",
    "grpc._simple_stubs",
    "grpc.experimental",
)
# Modules whose model wrappers import torch._dynamo when a model is first wrapped.
_WRAPPERS_LOADING_DYNAMO = ("torch.nn.parallel", "torch.distributed.fsdp")
_MAX_MESSAGE = 1 << 20  # bytes: a request carries one rank's environment
_PIPES_PER_RANK = 2  # stdout, stderr
_EXIT_USAGE = 2
_EXIT_CANNOT_RUN = 127  # like a shell that cannot run the command


def python_target(command: Sequence[str]) -> list[str] | None:
    """What the server runs for ``command``, or None where a fresh process must run it.

    The server runs Python scripts and modules with this interpreter, the two forms ``collsvc run``
    starts: ``[sys.executable, "script.py", args...]`` and ``[sys.executable, "-m", "module", args...]``.
    Other commands (another interpreter, interpreter options, a program) start as their own processes.

    Returns:
        ``command`` without the interpreter: ``["script.py", ...]`` or ``["-m", "module", ...]``.
    """
    if len(command) < 2 or command[0] != sys.executable:
        return None
    if command[1] == "-m":
        return list(command[1:]) if len(command) >= 3 else None
    return None if command[1].startswith("-") else list(command[1:])


class _Server:
    """The serving loop: requests from the launcher, ranks' exits from SIGCHLD."""

    def __init__(self, channel: socket.socket) -> None:
        self.channel = channel
        self.children: dict[int, int] = {}  # pid -> ident
        # ident -> pid, also after the rank ended: its process group may outlive it (what it started)
        self.pids: dict[int, int] = {}
        self.closed = False
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        os.set_blocking(self.wake_write, False)

    def serve(self) -> dict[str, Any] | None:
        """Serves until the launcher is gone and every rank ended (returns None), or, in a forked rank,
        returns its start request."""
        signal.set_wakeup_fd(self.wake_write)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes the selector via the fd
        with selectors.DefaultSelector() as selector:
            selector.register(self.channel, selectors.EVENT_READ, "channel")
            selector.register(self.wake_read, selectors.EVENT_READ, "wake")
            while not self.closed or self.children:
                for key, _ in selector.select():
                    if key.data == "wake":
                        with contextlib.suppress(BlockingIOError):
                            os.read(self.wake_read, 4096)
                        self._reap()
                    elif not self.closed:
                        request = self._receive(selector)
                        if request is not None:
                            return request
                self._reap()
        return None

    def _receive(self, selector: selectors.BaseSelector) -> dict[str, Any] | None:
        try:
            data, fds, _, _ = socket.recv_fds(self.channel, _MAX_MESSAGE, _PIPES_PER_RANK)
        except OSError:
            data, fds = b"", []
        if not data:
            self.closed = True
            selector.unregister(self.channel)
            return None
        request = json.loads(data)
        if "signal" in request:
            pid = self.pids.get(request["signal"])
            if pid is not None:
                _signal_group(pid, request["signum"])
            return None
        try:
            pid = os.fork()
        except OSError as exc:  # no memory or process slots: this rank fails, the server serves on
            print(f"collsvc run: cannot fork rank {request['start']}: {exc}", file=sys.stderr, flush=True)
            pid = -1
        if pid == 0:
            return {**request, "pipes": fds}
        for fd in fds:
            os.close(fd)
        if pid < 0:
            self._send({"exited": request["start"], "returncode": _EXIT_CANNOT_RUN})
            return None
        self.children[pid] = request["start"]
        self.pids[request["start"]] = pid
        self._send({"started": request["start"], "pid": pid})
        return None

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            ident = self.children.pop(pid, None)
            if ident is not None:
                self._send({"exited": ident, "returncode": os.waitstatus_to_exitcode(status)})

    def _send(self, message: dict[str, Any]) -> None:
        if self.closed:
            return
        with contextlib.suppress(OSError):  # the launcher is gone: the ranks die with this process
            self.channel.send(json.dumps(message).encode())

    def leave_in_child(self) -> None:
        """In a forked rank: drops the server's handlers, pipe and socket."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (self.wake_read, self.wake_write):
            os.close(fd)
        self.channel.close()


def _signal_group(pid: int, signum: int) -> None:
    """Signals the rank ``pid`` and what it started (its process group, once it has made its session)."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:  # forked but not yet in its own session: the rank alone
        with contextlib.suppress(OSError):
            os.kill(pid, signum)
    except OSError:
        pass


def _become_rank(request: dict[str, Any], server_pid: int) -> None:
    """Sets a forked process up as a fresh interpreter running ``request["command"]`` would be."""
    from collsvc.launch.parent_watch import set_parent_death_signal

    os.setsid()  # its own process group: stopping the rank stops what it started
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != server_pid:  # the server died before the setting took effect
        os.kill(os.getpid(), signal.SIGKILL)
    stdout, stderr = request["pipes"]
    null = os.open(os.devnull, os.O_RDONLY)
    for source, target in ((null, 0), (stdout, 1), (stderr, 2)):
        os.dup2(source, target)
        os.close(source)
    keep = {*request["keep_fds"], *request["preload_fds"]}
    for fd in sorted(int(name) for name in os.listdir("/proc/self/fd")):
        if fd > 2 and fd not in keep:  # as Popen(close_fds=True) leaves a fresh process
            with contextlib.suppress(OSError):
                os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    importlib.invalidate_caches()  # files written since the server loaded its modules are found
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def _run_target(target: list[str]) -> None:
    """Runs ``target`` (see :func:`python_target`) as ``__main__``, as ``python TARGET...`` would."""
    if target[0] == "-m":
        sys.argv = ["-m", *target[2:]]  # runpy puts the module's path in argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        return
    script = target[0]
    sys.argv = list(target)
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    with open(script, "rb") as handle:
        source = handle.read()
    path = os.path.abspath(script)
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __spec__=None, __cached__=None, __package__=None, __file__=path)
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    exec(compile(source, path, "exec"), main.__dict__)  # noqa: S102 - the user's script, as the interpreter would run it


def _rank_main(request: dict[str, Any], server_pid: int) -> NoReturn:
    """Runs one rank to its end and exits as its interpreter would (atexit, non-daemon threads)."""
    _become_rank(request, server_pid)
    try:
        _run_target(request["command"])
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - reported as the interpreter reports it
        traceback = exc.__traceback__
        while traceback is not None and traceback.tb_frame.f_code.co_filename == __file__:
            traceback = traceback.tb_next  # the user's frames only, as a fresh interpreter shows them
        sys.excepthook(type(exc), exc.with_traceback(traceback), traceback)  # it prints exc's own
        raise SystemExit(1) from None
    raise SystemExit(0)


def nvidia_gpu_present() -> bool:
    """Whether this host has an NVIDIA GPU driver (its control device or its /proc entry)."""
    return os.path.exists("/dev/nvidiactl") or os.path.isdir("/proc/driver/nvidia")


def script_preloads(command: Sequence[str]) -> list[str]:
    """The torch modules (``torch``, ``torch.*``, ``collsvc.torch``) a script imports at its top level
    (also inside top-level ``try`` and ``if`` blocks), which the server loads for its ranks, and
    ``torch._dynamo`` where one of them is DDP's or FSDP's (wrapping a model imports it); none for a
    module (``-m``), a script it cannot read or parse, or another command. Importing these starts no
    thread and no CUDA context on a CPU build, so the ranks fork from them as torch's own DataLoader
    workers do. None on a host with an NVIDIA GPU: a CUDA process cannot be forked once the CUDA driver
    was initialized in it, and whether a CUDA build of torch initializes it while loading is not
    verified for every version, so there each rank loads torch itself."""
    target = python_target(command)
    if target is None or target[0] == "-m" or nvidia_gpu_present():
        return []
    try:
        with open(target[0], "rb") as handle:
            tree = ast.parse(handle.read())
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    statements: list[ast.stmt] = list(tree.body)
    while statements:
        statement = statements.pop(0)
        if isinstance(statement, ast.Import):
            names += [alias.name for alias in statement.names]
        elif isinstance(statement, ast.ImportFrom) and statement.module and not statement.level:
            names.append(statement.module)
        elif isinstance(statement, (ast.If, ast.Try)):
            statements += statement.body + statement.orelse
    wanted = [n for n in names if n == "torch" or n.startswith("torch.") or n == "collsvc.torch"]
    if any(n.startswith(_WRAPPERS_LOADING_DYNAMO) for n in wanted):
        wanted.append("torch._dynamo")  # DDP's and FSDP's constructors import it: ~800 modules, ~1.3 s
    return list(dict.fromkeys(wanted))


def main(argv: Sequence[str]) -> None:
    """Loads :data:`PRELOADED` and the modules ``argv[1:]``, then serves the launcher on the socket whose
    fd is ``argv[0]``."""
    if not argv or not argv[0].isdigit():
        print("usage: fork_server.py SOCKET_FD [MODULE ...]", file=sys.stderr)
        sys.exit(_EXIT_USAGE)
    channel = socket.socket(fileno=int(argv[0]))
    before = set(os.listdir("/proc/self/fd"))
    for name in (*PRELOADED, *argv[1:]):
        with contextlib.suppress(Exception):  # the rank imports it again, and reports what fails
            importlib.import_module(name)
    preload_fds = [int(fd) for fd in set(os.listdir("/proc/self/fd")) - before]  # theirs: kept in ranks
    # What was loaded stays shared with the ranks: their garbage collector no longer walks (and so
    # copies) the pages of those objects. Python's documented recipe for fork without exec.
    gc.freeze()
    server = _Server(channel)
    server_pid = os.getpid()
    request = server.serve()
    if request is None:
        # Done, and nothing of ours to flush or close: skip tearing down what was loaded (~1 s with torch)
        os._exit(0)
    server.leave_in_child()
    request["preload_fds"] = preload_fds
    try:
        _rank_main(request, server_pid)
    except OSError as exc:
        print(f"collsvc run: cannot start the rank: {exc}", file=sys.stderr)
        os._exit(_EXIT_CANNOT_RUN)


if __name__ == "__main__":
    main(sys.argv[1:])
