"""The rank side of the conformance suite: turns each :class:`~tests.conformance.cases.Case` into
arrays, calls the API and compares with numpy, three times in the same buffers, interleaved.

Every rank computes every other rank's input from ``(case seed, global rank, repetition)``, so each
checks its own result against a numpy reference with no extra collective. A wrong result is recorded
and the batch goes on; so is an argument error every rank raised alike before sending anything (the
ranks stay in step). An error that breaks the job or leaves it out of step (a mismatch, a timeout, a
failed member) ends the batch: the parent starts a new job for the cases after the window that broke.
"""

from __future__ import annotations

import hashlib
import time
import traceback
from typing import Any

import numpy as np

import collsvc
from collsvc.types import ReduceOp
from tests.conformance.cases import Case, group_ranks, input_shape, strided
from tests.multiproc.checks import assert_close, np_dtype, reference

REPEATS = 3
SENTINEL = 7  # what an out that must stay untouched holds


class CaseFailure(AssertionError):
    """A result differs from numpy's, or the call raised another error than the one promised."""


# -- inputs ---------------------------------------------------------------------------------------------
def make(seed: int, rank: int, rep: int, dtype: str, shape: tuple[int, ...], part: int = 0) -> np.ndarray:
    """Deterministic input of global ``rank`` for repetition ``rep`` of a case (any rank recomputes any other's)."""
    rng = np.random.default_rng([seed, rank, rep, part])
    dt = np_dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dt.kind == "u":
        return rng.integers(0, 4, size=shape).astype(dt)
    if dt.kind == "i":
        return rng.integers(-3, 4, size=shape).astype(dt)
    if dt.kind == "c":
        return (rng.uniform(-1, 1, size=shape) + 1j * rng.uniform(-1, 1, size=shape)).astype(dt)
    return rng.uniform(-1, 1, size=shape).astype(np.float32).astype(dt)


def _torch() -> Any:
    import torch

    return torch


def as_kind(array: np.ndarray, kind: str) -> Any:
    """``array``'s memory as a ``kind`` array (a CPU torch tensor shares it)."""
    if kind == "numpy":
        return array
    torch = _torch()
    if array.dtype == np_dtype("bfloat16"):
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def to_numpy(value: Any, kind: str, dtype: str) -> np.ndarray:
    """A result of ``kind`` as numpy (checks its kind first)."""
    if kind == "numpy":
        if type(value) is not np.ndarray:
            raise CaseFailure(f"result is {type(value).__name__}, not numpy.ndarray")
        return value
    torch = _torch()
    if not isinstance(value, torch.Tensor):
        raise CaseFailure(f"result is {type(value).__name__}, not torch.Tensor")
    if value.dtype == torch.bfloat16:
        return value.view(torch.uint16).numpy().view(np_dtype("bfloat16"))
    return value.numpy()


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).view(np.uint8).tobytes()).hexdigest()[:16]


class Buffers:
    """One case's arrays on one rank, kept across its repetitions: the input (contiguous, or a strided
    view of a larger base: ``strided_x``), an ``out`` (a strided view for "strided_out") and the list
    forms' pieces."""

    def __init__(
        self, case: Case, shape: tuple[int, ...], result_shape: tuple[int, ...] | None, *, strided_x: bool
    ) -> None:
        dt = np_dtype(case.dtype)
        self.case = case
        self.strided_x = strided_x
        if strided_x:
            base = np.zeros((shape[0], 2 * shape[1]), dt)
            self.base = base
            self.x_np = base[:, ::2]
        else:
            self.base = np.zeros(shape, dt)
            self.x_np = self.base
        self.x = as_kind(self.x_np, case.kind) if case.kind == "numpy" else _torch_view(self.base, strided_x)
        self.out_np: np.ndarray | None = None
        self.out: Any = None
        if result_shape is not None and case.form == "strided_out":
            out_base = np.zeros((result_shape[0], 2 * result_shape[1]), dt)
            self.out_np = out_base[:, ::2]
            self.out = as_kind(self.out_np, case.kind) if case.kind == "numpy" else as_kind(out_base, case.kind)[:, ::2]
        elif result_shape is not None:
            self.out_np = np.zeros(result_shape, dt)
            self.out = as_kind(self.out_np, case.kind)
        self.extra_np = np.zeros((3,), dt)  # the list forms' second array
        self.extra = as_kind(self.extra_np, case.kind)

    def fill(self, values: np.ndarray, extra: np.ndarray) -> None:
        self.x_np[...] = values
        self.extra_np[...] = extra
        if self.out_np is not None and self.out_np.flags.writeable:
            self.out_np[...] = np.array(SENTINEL).astype(self.out_np.dtype)


def _torch_view(base: np.ndarray, strided_x: bool) -> Any:
    tensor = as_kind(base, "torch")
    return tensor[:, ::2] if strided_x else tensor


# -- one call -------------------------------------------------------------------------------------------
class Context:
    """This rank's communicators and what every case needs to know of them."""

    def __init__(self, comm: collsvc.Communicator, groups: dict[str, collsvc.Communicator | None], fast: bool) -> None:
        self.world = comm
        self.groups = groups
        self.fast = fast  # every group is on one host with shared memory: repeated calls take the fast path


def result_shape(case: Case, shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    if case.coll in ("all_gather", "gather"):
        return (n,) if not shape else (n * shape[0], *shape[1:])
    if case.coll in ("reduce_scatter", "scatter") and shape:  # a 0-d input is an error case
        return (shape[0] // n, *shape[1:])
    return shape


class Runner:
    """Runs the cases of one window on one rank, repetition by repetition."""

    def __init__(self, ctx: Context, case: Case) -> None:
        self.ctx, self.case = ctx, case
        comm = ctx.groups.get(case.group) if case.group != "world" else ctx.world
        self.comm = comm
        self.members = group_ranks(case.group, ctx.world.size)
        n = len(self.members)
        self.n = n
        self.shape = input_shape(case, n)
        if case.form == "rows":  # not divisible by the group size
            self.shape = (n * 2 + 1,)
        self.rshape = result_shape(case, self.shape, n) if case.form != "rows" else self.shape
        out_shape = self.rshape
        if case.form == "out_shape":
            out_shape = (self.rshape[0] + 1, *self.rshape[1:]) if self.rshape else (2,)
        needs_out = case.form in ("out", "strided_out", "none_x", "out_shape", "out_dtype", "out_readonly") or (
            case.coll == "send_recv" and case.form in ("out", "noncontig")
        )
        # "mixed": the last member's x is strided (its repeats take the general path, the others' the fast one).
        me = comm.rank if comm is not None else -1
        strided_x = strided(case.form) and case.form != "strided_out" and (case.form != "mixed" or me == n - 1)
        self.buffers = Buffers(case, self.shape, out_shape if needs_out else None, strided_x=strided_x)
        if case.form == "out_dtype":
            other = np.complex128 if case.dtype != "complex128" else np.float32
            self.buffers.out_np = np.zeros(out_shape, other)
            self.buffers.out = self.buffers.out_np
        if case.form == "out_readonly":
            assert self.buffers.out_np is not None
            self.buffers.out_np.flags.writeable = False
        self.digests: list[str] = []

    def inputs(self, rep: int, part: int = 0, shape: tuple[int, ...] | None = None) -> list[np.ndarray]:
        """Every member's input (group order) for repetition ``rep``."""
        shape = self.shape if shape is None else shape
        return [make(self.case.seed, g, rep, self.case.dtype, shape, part) for g in self.members]

    def run(self, rep: int) -> None:
        """Repetition ``rep`` of the case on this rank (nothing where this rank is not a member).

        Raises:
            CaseFailure: the result (or the error) is not what the API promises.
            CollsvcError: the call failed.
        """
        if self.comm is None:
            return
        case, comm = self.case, self.comm
        me = comm.rank
        mine = make(case.seed, self.members[me], rep, case.dtype, self.shape)
        extra = make(case.seed, self.members[me], rep, case.dtype, (3,), part=1)
        self.buffers.x_np.flags.writeable = True
        self.buffers.fill(mine, extra)
        if case.form == "readonly":
            self.buffers.x_np.flags.writeable = False  # a torch tensor of it stays writable
        before = np.array(self.buffers.x_np, copy=True)
        if case.expect is not None:
            self._expect_error()
            return
        handler = getattr(self, f"_{case.coll}")
        handler(rep, me)
        if self.ctx.fast and rep > 0 and self._takes_fast_path():
            arg: Any = ReduceOp[case.op] if case.op else case.root
            out = self.buffers.x_np if case.form == "inplace" else self.buffers.out_np if case.form == "out" else None
            if not comm._repeated.has_fast_path(case.coll, self.buffers.x_np, arg, out):
                raise CaseFailure("a repeated call on one host has no fast path (client/fast_path.py)")
        if (
            self.ctx.fast
            and rep > 0
            and case.coll == "barrier"
            and self.n > 1
            and not comm._repeated.has_fast_path("barrier")
        ):
            raise CaseFailure("a repeated barrier on one host has no fast path (client/fast_path.py)")
        written = case.form in ("inplace", "noncontig_inplace") and (case.coll != "reduce" or me == case.root)
        same = np.array_equal(self.buffers.x_np, before, equal_nan=self.buffers.x_np.dtype.kind in "fc")
        if not written and case.coll not in ("barrier", "objects") and not same:
            raise CaseFailure("the call wrote into its input x")

    def _takes_fast_path(self) -> bool:
        """Whether repeats of this call must take the fast path for repeated calls: synchronous, numpy,
        contiguous, new result or ``out=x`` (all_gather, reduce_scatter, all_to_all: or an ``out``), of a
        group of two or more on one host, of a dtype numpy reduces natively (client/fast_path.py); of the
        "mixed" form, on every member but the last (whose strided x takes the general path)."""
        case = self.case
        if case.coll not in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all"):
            return False
        forms = (
            ("plain", "inplace", "out")
            if case.coll in ("all_gather", "reduce_scatter", "all_to_all")
            else (
                "plain",
                "inplace",
            )
        )
        mixed = case.form == "mixed" and not self.buffers.strided_x
        return (
            (case.form in forms or mixed)
            and case.kind == "numpy"
            and case.dtype != "bfloat16"
            and case.shape in ("one", "1d", "2d")
            and self.n > 1
        )

    # -- error cases
    def _expect_error(self) -> None:
        case, comm = self.case, self.comm
        assert comm is not None
        b = self.buffers
        op = ReduceOp[case.op] if case.op else None
        root = case.root
        kwargs: dict[str, Any] = {}
        if case.form in ("out_shape", "out_dtype", "out_readonly"):
            kwargs["out"] = b.out
        x: Any = b.x
        if case.form == "list_dtypes":
            x = [b.x, np.zeros(3, np.float64 if case.dtype != "float64" else np.float32)]
        if case.form == "mismatch" and comm.rank == self.n - 1:
            x = b.x_np.astype(np.float64)  # the others call with the case's dtype
        expected = {
            "TypeError": TypeError,
            "ValueError": ValueError,
            "CollectiveMismatchError": collsvc.CollectiveMismatchError,
        }[case.expect or ""]
        try:
            if case.coll == "all_reduce":
                comm.all_reduce(x, op, **kwargs)
            elif case.coll == "reduce":
                comm.reduce(x, root, op, **kwargs)
            elif case.coll == "reduce_scatter":
                comm.reduce_scatter(x, op, **kwargs)
            elif case.coll == "broadcast":
                comm.broadcast(x, root, **kwargs)
            elif case.coll == "all_gather":
                comm.all_gather(x, **kwargs)
            elif case.coll == "all_to_all":
                comm.all_to_all(x, **kwargs)
            elif case.coll == "scatter":
                comm.scatter(x, root, **kwargs)
            elif case.coll == "gather":
                comm.gather(x, root, **kwargs)
            elif case.coll == "send_recv":
                comm.send(x, 0)
        except expected:
            return
        except Exception as exc:  # noqa: BLE001 - the wrong error is the finding
            raise CaseFailure(f"raised {type(exc).__name__}: {exc}, not {case.expect}") from exc
        raise CaseFailure(f"returned instead of raising {case.expect}")

    # -- helpers
    def _check(self, got: Any, expected: np.ndarray, what: str, *, reduced: bool = False) -> np.ndarray:
        case = self.case
        array = to_numpy(got, case.kind, case.dtype)
        if array.dtype != np_dtype(case.dtype):
            raise CaseFailure(f"{what}: dtype {array.dtype}, expected {np_dtype(case.dtype)}")
        try:
            if reduced:
                assert_close(array, expected, case.dtype, what, self.n)
            else:
                if array.shape != expected.shape:
                    raise AssertionError(f"{what}: shape {array.shape} != {expected.shape}")
                if not np.array_equal(array, expected):
                    raise AssertionError(f"{what}: differs from numpy at {int(np.sum(array != expected))} elements")
        except AssertionError as exc:
            raise CaseFailure(str(exc)) from None
        self.digests.append(digest(array))
        return array

    def _call(self, fn: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        """Calls ``fn`` in the case's form: out=, in place, async (wait, then result)."""
        form, b = self.case.form, self.buffers
        if form in ("out", "strided_out", "none_x"):
            kwargs["out"] = b.out
        elif form in ("inplace", "noncontig_inplace"):
            kwargs["out"] = x
        if form == "async":
            work = fn(x, *args, async_op=True, **kwargs)
            if not work.wait(timeout=60):
                raise CaseFailure("wait() returned False")
            if not work.is_completed():
                raise CaseFailure("is_completed() is False after wait()")
            return self._new_result(work.result(), kwargs)
        result = fn(x, *args, **kwargs)
        if "out" in kwargs and kwargs["out"] is not None and result is not None and result is not kwargs["out"]:
            raise CaseFailure("the result is not the given out")
        return self._new_result(result, kwargs)

    def _new_result(self, result: Any, kwargs: dict[str, Any]) -> Any:
        """``result``, checked to be an array of its own where no ``out`` was given (not a view of x:
        the caller may write to either without changing the other)."""
        if kwargs.get("out") is None and result is not None:
            array = to_numpy(result, self.case.kind, self.case.dtype)
            if np.may_share_memory(array, self.buffers.x_np):
                raise CaseFailure("without out, the result shares memory with x")
        return result

    def _list(self, rep: int) -> tuple[list[Any], list[list[np.ndarray]]]:
        """The list forms' arrays and each one's inputs on every member ("list_one": x alone)."""
        b = self.buffers
        if self.case.form == "list_one":
            return [b.x], [self.inputs(rep, 0, self.shape)]
        return [b.x, b.extra], [self.inputs(rep, 0, self.shape), self.inputs(rep, 1, (3,))]

    # -- collectives
    def _all_reduce(self, rep: int, me: int) -> None:
        case, comm = self.case, self.comm
        assert comm is not None
        op = ReduceOp[case.op or "SUM"]
        if case.form in ("list", "list_one"):
            xs, parts = self._list(rep)
            got = comm.all_reduce(xs, op)
            for k, inputs in enumerate(parts):
                self._check(got[k], reference(op, inputs), f"piece {k}", reduced=True)
            return
        if case.form == "compressed":  # within one host: exact (compression applies between hosts)
            got = comm.all_reduce(self.buffers.x, op, compression="bf16")
        else:
            got = self._call(comm.all_reduce, self.buffers.x, op)
        self._check(got, reference(op, self.inputs(rep)), "all_reduce", reduced=True)

    def _reduce(self, rep: int, me: int) -> None:
        case, comm, b = self.case, self.comm, self.buffers
        assert comm is not None and case.root is not None
        op = ReduceOp[case.op or "SUM"]
        got = self._call(comm.reduce, b.x, case.root, op)
        if me == case.root:
            self._check(got, reference(op, self.inputs(rep)), "reduce", reduced=True)
            return
        if case.form in ("out", "strided_out"):
            assert b.out_np is not None
            if got is not None and got is not b.out:
                raise CaseFailure(f"a non-root rank got {type(got).__name__}, not None or its out")
            if not np.all(b.out_np == np.array(SENTINEL).astype(b.out_np.dtype)):
                raise CaseFailure("a non-root rank's out was written")
        elif got is not None:
            raise CaseFailure(f"a non-root rank got {type(got).__name__}, not None")

    def _broadcast(self, rep: int, me: int) -> None:
        case, comm = self.case, self.comm
        assert comm is not None and case.root is not None
        if case.form in ("list", "list_one"):
            xs, parts = self._list(rep)
            got = comm.broadcast(xs, case.root)
            for k, inputs in enumerate(parts):
                self._check(got[k], inputs[case.root], f"piece {k}")
            return
        got = self._call(comm.broadcast, self.buffers.x, case.root)
        self._check(got, self.inputs(rep)[case.root], "broadcast")

    def _all_gather(self, rep: int, me: int) -> None:
        comm = self.comm
        assert comm is not None
        if self.case.form in ("list", "list_one"):
            xs, parts = self._list(rep)
            got = comm.all_gather(xs)
            for k, inputs in enumerate(parts):
                self._check(got[k], np.concatenate([np.atleast_1d(a) for a in inputs]), f"piece {k}")
            return
        got = self._call(comm.all_gather, self.buffers.x)
        self._check(got, np.concatenate([np.atleast_1d(a) for a in self.inputs(rep)]), "all_gather")

    def _gather(self, rep: int, me: int) -> None:
        case, comm = self.case, self.comm
        assert comm is not None and case.root is not None
        got = self._call(comm.gather, self.buffers.x, case.root)
        if me == case.root:
            self._check(got, np.concatenate([np.atleast_1d(a) for a in self.inputs(rep)]), "gather")
        elif got is not None:
            raise CaseFailure(f"a non-root rank got {type(got).__name__}, not None")

    def _reduce_scatter(self, rep: int, me: int) -> None:
        case, comm = self.case, self.comm
        assert comm is not None
        op = ReduceOp[case.op or "SUM"]
        got = self._call(comm.reduce_scatter, self.buffers.x, op)
        rows = self.rshape[0]
        full = reference(op, self.inputs(rep))
        self._check(got, full[me * rows : (me + 1) * rows], "reduce_scatter", reduced=True)

    def _scatter(self, rep: int, me: int) -> None:
        case, comm = self.case, self.comm
        assert comm is not None and case.root is not None
        x = None if case.form == "none_x" and me != case.root else self.buffers.x
        got = self._call(comm.scatter, x, case.root)
        rows = self.rshape[0]
        self._check(got, self.inputs(rep)[case.root][me * rows : (me + 1) * rows], "scatter")

    def _all_to_all(self, rep: int, me: int) -> None:
        comm = self.comm
        assert comm is not None
        got = self._call(comm.all_to_all, self.buffers.x)
        rows = self.shape[0] // self.n
        expected = np.concatenate([a[me * rows : (me + 1) * rows] for a in self.inputs(rep)])
        self._check(got, expected, "all_to_all")

    def _send_recv(self, rep: int, me: int) -> None:
        case, comm, b = self.case, self.comm, self.buffers
        assert comm is not None
        n = self.n
        right, left = (me + 1) % n, (me - 1) % n
        tag = rep  # 0 too: the smallest tag
        comm.send(b.x, right, tag=tag)
        expected = self.inputs(rep)[left]
        if case.form in ("out", "noncontig"):
            got = comm.recv(left, tag=tag, out=b.out)
            if got is not b.out:
                raise CaseFailure("recv's result is not the given out")
        elif case.form == "any":
            source, got = comm.recv_any(tag=tag, shape=self.shape, dtype=np_dtype(case.dtype))
            if source != left:
                raise CaseFailure(f"recv_any: source {source}, expected {left}")
        else:
            got = comm.recv(left, tag=tag, shape=self.shape, dtype=np_dtype(case.dtype))
        if case.form not in ("out", "noncontig") and case.kind != "numpy":
            got = as_kind(got, case.kind)  # recv and recv_any with shape= give numpy
        self._check(got, np.array(expected, copy=True), "recv")

    def _barrier(self, rep: int, me: int) -> None:
        comm = self.comm
        assert comm is not None
        if self.case.form == "timeout":
            comm.barrier(timeout=60)
        else:
            comm.barrier()

    def _objects(self, rep: int, me: int) -> None:
        comm, case = self.comm, self.case
        assert comm is not None
        if case.form == "broadcast_object":
            root = case.root or 0
            got = comm.broadcast_object({"from": self.members[me], "rep": rep, "a": [1, 2]}, src=root)
            if got != {"from": self.members[root], "rep": rep, "a": [1, 2]}:
                raise CaseFailure(f"broadcast_object gave {got!r}")
        else:
            got = comm.all_gather_object(("rank", self.members[me], rep))
            if got != [("rank", g, rep) for g in self.members]:
                raise CaseFailure(f"all_gather_object gave {got!r}")


def _broken(exc: BaseException) -> bool:
    """Whether ``exc`` leaves the job out of step (the batch must stop)."""
    if isinstance(exc, collsvc.CollectiveMismatchError):
        return False  # agreed by every rank at the same step
    return isinstance(exc, collsvc.CollsvcError)


def _run_window(
    ctx: Context, window: list[Case], failures: list[tuple[str, int, str]], timing: dict[str, float]
) -> tuple[list[Runner | None], str | None]:
    """Runs one window's cases, repetition by repetition (rep 0 of each, then rep 1, ...); returns its
    runners and the error that left the job out of step (None if none did)."""
    runners: list[Runner | None] = []
    for case in window:
        try:
            runners.append(Runner(ctx, case))
        except Exception:  # noqa: BLE001 - a case this rank cannot even set up is a finding
            failures.append((case.describe(), -1, traceback.format_exc(limit=3)))
            runners.append(None)
    for rep in range(REPEATS):
        for case, runner in zip(window, runners, strict=True):
            if runner is None:
                continue
            began = time.perf_counter()
            try:
                runner.run(rep)
            except CaseFailure as exc:
                failures.append((case.describe(), rep, str(exc)[:2000]))
            except Exception as exc:  # noqa: BLE001 - every error is reported with its case
                failures.append((case.describe(), rep, f"{type(exc).__name__}: {exc}"[:2000]))
                if _broken(exc):
                    return runners, f"{case.describe()} rep {rep}: {type(exc).__name__}: {exc}"[:2000]
            finally:
                name = case.describe()
                timing[name] = timing.get(name, 0.0) + time.perf_counter() - began
    return runners, None


def _run_finals(ctx: Context, finals: list[Case], failures: list[tuple[str, int, str]]) -> None:
    """Runs each case of ``finals`` once (repetition 0); the first that raises what it promises (a
    mismatch: the job is broken then) ends them."""
    for case in finals:
        try:
            Runner(ctx, case).run(0)
        except Exception as exc:  # noqa: BLE001 - every error is reported with its case
            failures.append((case.describe(), 0, f"{type(exc).__name__}: {exc}"[:2000]))
            return
        if case.expect is not None:
            return


def run_batch(
    rank: int, windows: list[list[Case]], timeout: float, fast: bool, finals: list[Case] | None = None
) -> dict[str, Any]:
    """Runs ``windows`` of cases on this rank (a job's body): returns ``failures`` (case, rep, message),
    ``digests`` (case -> result digests, to compare across ranks), ``done`` (windows finished),
    ``broken`` (the error that ended the batch early, or None) and ``timing`` (seconds per case).
    ``fast``: every rank is on one host with shared memory, so repeated calls must take the fast path.
    ``finals``: cases that break the job when they pass (a mismatch), run once after every window."""
    if any(case.kind == "torch" for window in windows for case in window):
        import torch

        torch.set_num_threads(1)
    comm = collsvc.init(timeout=timeout)
    failures: list[tuple[str, int, str]] = []
    digests: dict[str, list[str]] = {}
    timing: dict[str, float] = {}
    done, broken = 0, None
    try:
        n = comm.size
        groups: dict[str, collsvc.Communicator | None] = {}
        for name in ("tail", "ends"):
            ranks = group_ranks(name, n)
            if n > 1 and len(ranks) < n:
                groups[name] = comm.new_group(ranks, name=f"conformance-{name}")
        ctx = Context(comm, groups, fast)
        for window in windows:
            runners, broken = _run_window(ctx, window, failures, timing)
            if broken is not None:
                break
            for case, runner in zip(window, runners, strict=True):
                if runner is not None and runner.digests:
                    digests[case.describe()] = runner.digests
            done += 1
        if broken is None and finals:
            _run_finals(ctx, finals, failures)
        elif broken is None:
            comm.barrier()
    finally:
        if broken is None:
            collsvc.destroy()
    return {"failures": failures, "digests": digests, "done": done, "broken": broken, "timing": timing}
