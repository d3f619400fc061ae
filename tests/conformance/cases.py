"""The conformance cases: every call form of docs/api.md as a table, generated, not hand-picked.

A :class:`Case` names one call (collective, form, dtype, op, shape, size class, root, group, array
kind); the rank side (``ranks.py``) turns it into arrays from ``(case seed, rank, repetition)``, calls
the API and compares with numpy. :func:`generate` makes the table for one world size and transport:
the whole cross product (``level="full"``), or a slice that still holds every form, dtype, op, size
class, group and kind (``level="ci"``): the slice picks, for each axis value, the cases of the
product that cover it, rotating the other axes.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from collsvc.types import DTYPE_CODES, ReduceOp
from tests.multiproc.checks import allowed, np_dtype

DTYPES = list(DTYPE_CODES)
OPS = [op.name for op in ReduceOp]

# Size classes: the paths a call takes by its bytes (client/backends/shm/prepared.py, group.py,
# ring/algorithms_common.py). "tiny": one shared-memory step, doubling / trees over gRPC; "step":
# exactly DIRECT_BYTES (64 KiB), the largest one-step call; "chunked": above 256 KiB (pipelined
# all_reduce within one 4 MiB slot, a broadcast in pieces, the repeated-call Chunked* classes);
# "slots": above one 4 MiB slot (several pipeline chunks; over gRPC, 2 MiB frames and the
# ring / chain algorithms above 2 MiB).
DIRECT_BYTES = 64 * 1024
SLOT_BYTES = 4 << 20
SIZES = ["tiny", "step", "chunked", "slots"]

REDUCING = ("all_reduce", "reduce", "reduce_scatter")
ROOTED = ("reduce", "broadcast", "gather", "scatter")
# Collectives whose input is split in ``size`` blocks along axis 0.
ROWS = ("reduce_scatter", "scatter", "all_to_all")
COLLECTIVES = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "gather",
    "scatter",
    "all_to_all",
    "send_recv",
    "barrier",
    "objects",
)

# The call forms each collective defines (docs/api.md).
# "list_one": a list of one array; "strided_out": a strided ``out`` apart from ``x``; "mixed": the
# group's last member passes a strided view, the others a contiguous array (on one host, their repeats
# take the fast path while the last member's take the general path: the two must meet); "readonly": a
# read-only ``x`` (numpy) where the call only reads it.
FORMS: dict[str, tuple[str, ...]] = {
    "all_reduce": (
        "plain",
        "out",
        "inplace",
        "async",
        "list",
        "list_one",
        "noncontig",
        "noncontig_inplace",
        "strided_out",
        "mixed",
        "readonly",
    ),
    "reduce": ("plain", "out", "inplace", "async", "noncontig", "strided_out", "readonly"),
    "broadcast": (
        "plain",
        "out",
        "inplace",
        "async",
        "list",
        "list_one",
        "noncontig",
        "noncontig_inplace",
        "strided_out",
        "mixed",
    ),
    "all_gather": ("plain", "out", "async", "list", "list_one", "noncontig", "mixed", "readonly"),
    "reduce_scatter": ("plain", "out", "async", "noncontig", "mixed", "readonly"),
    "gather": ("plain", "out", "async", "noncontig", "readonly"),
    "scatter": ("plain", "out", "none_x", "async", "noncontig", "readonly"),
    "all_to_all": ("plain", "out", "async", "noncontig", "mixed", "readonly"),
    "send_recv": ("shape", "out", "any", "noncontig"),
    "barrier": ("plain", "timeout"),
    "objects": ("broadcast_object", "all_gather_object"),
}
# Shapes: 0-d, empty, one element (one row per member where split in blocks), 1-D and 2-D (a list form
# holds one of these and a small 1-D array).
SHAPES = ("0d", "empty", "one", "1d", "2d")
# Sub-communicators made with new_group on every world size: "tail" (ranks 1..n-1), "ends" (0 and n-1).
GROUPS = ("world", "tail", "ends")
KINDS = ("numpy", "torch")
# Local errors the API promises (raised on every rank before anything is sent).
ERRORS = ("op_dtype", "out_shape", "out_dtype", "out_readonly", "rows", "list_dtypes", "mismatch")
# The collectives that move array data among a group's members (not send/recv, barrier, objects).
GROUP_COLLECTIVES = tuple(c for c in COLLECTIVES if c not in ("send_recv", "barrier", "objects"))
# Over shared memory each call's first step checks the members' calls agree: a "mismatch" case (one per
# job, see mismatches()) raises CollectiveMismatchError on every member. By world size: reduce_scatter
# (its steps carry pieces for every peer), an all_reduce whose float64 side is pipelined while the
# float32 side takes one step, an all_gather (its steps carry pieces of one's own block).
MISMATCH_BY_SIZE = {2: ("reduce_scatter", "tiny"), 3: ("all_reduce", "step"), 4: ("all_gather", "tiny")}


@dataclass(frozen=True)
class Case:
    """One call of the conformance table; ``expect``: the error every rank must raise (or None)."""

    coll: str
    form: str
    dtype: str = "float32"
    op: str | None = None
    shape: str = "1d"
    size: str = "tiny"
    root: int | None = None
    group: str = "world"
    kind: str = "numpy"
    expect: str | None = None

    @property
    def seed(self) -> int:
        return zlib.crc32(self.describe().encode())

    def describe(self) -> str:
        parts = [self.coll, self.form, self.dtype]
        if self.op:
            parts.append(self.op)
        parts += [self.shape, self.size]
        if self.root is not None:
            parts.append(f"root={self.root}")
        if self.group != "world":
            parts.append(f"group={self.group}")
        if self.kind != "numpy":
            parts.append(self.kind)
        if self.expect:
            parts.append(f"raises {self.expect}")
        return " ".join(parts)


def group_ranks(group: str, world: int) -> list[int]:
    """The global ranks of ``group`` in a job of ``world`` ranks, in group order."""
    if group == "tail":
        return list(range(1, world))
    if group == "ends":
        return sorted({0, world - 1})
    return list(range(world))


def elements(size: str, dtype: str) -> int:
    """Elements of a ``size`` class call of ``dtype`` (whole input of one rank)."""
    item = np_dtype(dtype).itemsize
    if size == "tiny":
        return 15
    if size == "step":
        return DIRECT_BYTES // item
    if size == "chunked":
        return (5 * DIRECT_BYTES) // item + 7
    return (SLOT_BYTES + DIRECT_BYTES) // item + 3


def input_shape(case: Case, n: int) -> tuple[int, ...]:
    """This case's input shape on each rank of a group of ``n`` (rows divisible by ``n`` where needed)."""
    if case.shape == "0d":
        return ()
    if case.shape == "empty":
        return (0,) if case.coll not in ROWS else (0, 3)
    if case.shape == "one":
        return (n,) if case.coll in ROWS else (1,)
    count = elements(case.size, case.dtype)
    if case.coll == "scatter" or case.coll == "all_to_all" or case.coll == "reduce_scatter":
        if case.shape == "2d":
            cols = 3
            rows = max(n, (count // cols) // n * n)
            return (rows, cols)
        return (max(n, count // n * n),)
    if case.shape == "2d":
        return (max(1, count // 3), 3)
    return (count,)


def strided(form: str) -> bool:
    """Whether ``form`` passes a strided array (``x``, ``out``, or ``x`` on one member): 2-D cases only."""
    return form.startswith("noncontig") or form in ("strided_out", "mixed")


def torch_dtypes() -> set[str]:
    """The dtypes CPU torch tensors of this torch have (empty without torch)."""
    try:
        import torch
    except ImportError:
        return set()
    names = set()
    for name in DTYPES:
        if hasattr(torch, name):
            names.add(name)
    return names


def _roots(coll: str, n: int, level: str) -> list[int | None]:
    if coll not in ROOTED and coll != "objects":
        return [None]
    if level == "full":
        return list(range(n))
    return [n - 1] if n > 1 else [0]


def _ops(coll: str) -> list[str | None]:
    return list(OPS) if coll in REDUCING else [None]


def _valid(case: Case, n: int) -> bool:
    """Whether the case is a call the API defines in a job of ``n`` ranks (the error table is generated
    apart)."""
    members = len(group_ranks(case.group, n))
    if case.op is not None and not allowed(ReduceOp[case.op], case.dtype):
        return False
    if case.coll in ROWS and case.shape == "0d":
        return False
    if case.coll in ("barrier", "objects"):
        return case.dtype == "float32" and case.shape == "1d" and case.size == "tiny"
    if case.form in ("list", "list_one") and case.shape == "0d":
        return True
    if strided(case.form) and case.shape != "2d":
        return False
    if case.size != "tiny" and case.shape in ("0d", "empty", "one"):
        return False
    return not (case.coll == "send_recv" and members < 2)


def full_product(n: int, transport: str) -> Iterator[Case]:
    """The whole product, as a union of full cross products over the axes that interact (a product of
    every axis at once, ~10^5 cases per job, would take hours on two cores):

    1. kernels: every reducing collective x every dtype x every op x {tiny, chunked} x every kind
       (x roots 0 and n-1);
    2. forms: every collective x every form x every shape x {tiny, step, chunked} x every kind x
       {uint8, bfloat16, float64} (x roots 0 and n-1);
    3. paths: every collective x {plain, out, in place} x {step, chunked} x {uint8, float32, float64}
       x every root, and the same above one slot (float32, roots 0 and n-1);
    4. groups: every collective x every form x {tail, ends} x {tiny, step} (int32, every root of the group);
    5. the error table.
    """
    have_torch = torch_dtypes()
    seen: set[str] = set()

    def keep(case: Case) -> bool:
        members = len(group_ranks(case.group, n))
        if case.group != "world" and (n < 2 or members == n):
            return False
        if case.root is not None and case.root >= members:
            return False
        if case.kind == "torch" and case.dtype not in have_torch:
            return False
        name = case.describe()
        if name in seen or not _valid(case, n):
            return False
        seen.add(name)
        return True

    ends = sorted({0, n - 1})
    for coll in COLLECTIVES:
        forms, first = FORMS[coll], FORMS[coll][0]
        roots: list[int | None] = list(ends) if coll in ROOTED or coll == "objects" else [None]
        every_root: list[int | None] = list(range(n)) if roots != [None] else [None]
        products: list[Iterator[tuple[object, ...]]] = [
            itertools.product([first], DTYPES, _ops(coll), ["1d"], ["tiny", "chunked"], roots, ["world"], KINDS)
            if coll in REDUCING
            else iter(()),
            itertools.product(
                forms,
                ["uint8", "bfloat16", "float64"],
                _ops(coll)[:1] if coll in REDUCING else [None],
                SHAPES,
                ["tiny", "step", "chunked"],
                roots,
                ["world"],
                KINDS,
            ),
            itertools.product(
                [f for f in forms if f in (first, "out", "inplace")],
                ["uint8", "float32", "float64"],
                ["SUM"] if coll in REDUCING else [None],
                ["1d"],
                ["step", "chunked"],
                every_root,
                ["world"],
                ["numpy"],
            ),
            itertools.product(
                [f for f in forms if f in (first, "out", "inplace")],
                ["float32"],
                ["SUM"] if coll in REDUCING else [None],
                ["1d"],
                ["slots"],
                roots,
                ["world"],
                ["numpy"],
            ),
            itertools.product(
                forms,
                ["int32"],
                ["MAX"] if coll in REDUCING else [None],
                ["1d"],
                ["tiny", "step"],
                every_root,
                ["tail", "ends"],
                ["numpy"],
            ),
        ]
        for product in products:
            for form, dtype, op, shape, size, root, group, kind in product:
                case = Case(coll, form, dtype, op, shape, size, root, group, kind)  # type: ignore[arg-type]
                if keep(case):
                    yield case
    yield from errors(n)
    yield from mismatches(n, transport)
    yield from single_host(n, transport)


def errors(n: int) -> Iterator[Case]:
    """The typed errors the API promises, for every collective that can raise them on every rank."""
    for coll in REDUCING:
        for dtype, op in itertools.product(DTYPES, OPS):
            if not allowed(ReduceOp[op], dtype):
                root = 0 if coll == "reduce" else None
                yield Case(coll, "plain", dtype, op, "1d", root=root, expect="TypeError")
    for coll in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "scatter"):
        root = 0 if coll in ROOTED else None
        op = "SUM" if coll in REDUCING else None
        yield Case(coll, "out_shape", "float32", op, "2d", root=root, expect="ValueError")
        yield Case(coll, "out_dtype", "float32", op, "2d", root=root, expect="TypeError")
        yield Case(coll, "out_readonly", "float32", op, "2d", root=root, expect="ValueError")
    for coll in ROWS:
        root = 0 if coll in ROOTED else None
        op = "SUM" if coll in REDUCING else None
        yield Case(coll, "plain", "float32", op, "0d", root=root, expect="ValueError")
        if n > 1:
            yield Case(coll, "rows", "float32", op, "1d", root=root, expect="ValueError")
    for coll in ("all_reduce", "broadcast", "all_gather"):
        root = 0 if coll in ROOTED else None
        op = "SUM" if coll in REDUCING else None
        yield Case(coll, "list_dtypes", "float32", op, "1d", root=root, expect="TypeError")
    if n == 1:
        yield Case("send_recv", "shape", "float32", expect="ValueError")


def mismatches(n: int, transport: str) -> Iterator[Case]:
    """A call the members disagree on (the group's last member passes float64, the others float32), on
    one host with shared memory: every member raises CollectiveMismatchError. A mismatch breaks the job
    (``JobBrokenError``), so a job runs one, after every other case (``driver.py``); which one depends on
    the world size (:data:`MISMATCH_BY_SIZE`)."""
    if transport != "shm" or n not in MISMATCH_BY_SIZE:
        return
    coll, size = MISMATCH_BY_SIZE[n]
    root = n - 1 if coll in ROOTED else None
    op = "SUM" if coll in REDUCING else None
    yield Case(coll, "mismatch", "float32", op, "1d", size, root=root, expect="CollectiveMismatchError")


def single_host(n: int, transport: str) -> Iterator[Case]:
    """Calls whose result is exact only within one host: a compressed all_reduce (compression applies
    between hosts only, docs/api.md)."""
    if transport in ("shm", "noshm") and n > 1:
        yield Case("all_reduce", "compressed", "float32", "SUM", "1d")
        yield Case("all_reduce", "compressed", "float64", "AVG", "2d", "step")


# The CI jobs that run the whole dtype x op table (the shared-memory kernels and the gRPC algorithms'):
# the others run every dtype and every op, not every pair.
FULL_TABLE_JOBS = {(2, "shm"), (2, "grpc")}
# The thin jobs move data (broadcast, gathers, scatter, all_to_all, send/recv) in one dtype per family
# and width class; the full-table jobs in every dtype.
FAMILIES = ["bool", "int8", "uint16", "int64", "float16", "bfloat16", "float64", "complex64"]
# The CI jobs that run calls above one 4 MiB slot (several pipeline chunks or frames), and for which
# collectives: shared memory, gRPC frames, the hierarchical all_reduce's pipeline.
SLOTS_JOBS: dict[tuple[int, str], tuple[str, ...]] = {
    (4, "shm"): COLLECTIVES,
    (2, "grpc"): COLLECTIVES,
    (4, "hier"): ("all_reduce",),
}
# The quick slice's calls above one slot: every collective of a shared-memory group (pieces after the
# first start at a nonzero offset within each block), and the all_reduce over gRPC frames.
QUICK_SLOTS_JOBS: dict[tuple[int, str], tuple[str, ...]] = {
    (2, "shm"): GROUP_COLLECTIVES,
    (2, "grpc"): ("all_reduce",),
}


def ci_slice(n: int, transport: str, quick: bool = False) -> list[Case]:
    """A slice of :func:`full_product` that still holds every value of every axis, for each collective:
    every form (tiny, 1-D and 2-D), every dtype and op, every shape and size class, every group and
    kind, and the error table. Values are paired round-robin, so each case covers several axes."""
    have_torch = set() if quick and transport != "shm" else torch_dtypes()
    chosen: dict[str, Case] = {}
    thin = quick or (n, transport) not in FULL_TABLE_JOBS
    slots = QUICK_SLOTS_JOBS.get((n, transport), ()) if quick else SLOTS_JOBS.get((n, transport), ())

    def add(case: Case) -> None:
        if case.kind == "torch" and case.dtype not in have_torch:
            case = replace(case, kind="numpy")
        if _valid(case, n):
            chosen.setdefault(case.describe(), case)

    for coll in COLLECTIVES:
        forms = FORMS[coll]
        roots = _roots(coll, n, "ci")
        root = roots[0]
        if coll in ("barrier", "objects"):
            for form in forms:
                add(Case(coll, form, root=root))
                if n > 2:
                    add(Case(coll, form, root=0, group="tail"))
            continue
        # Every form, on a rotating dtype / shape / kind.
        for i, form in enumerate(forms):
            for shape in ("1d", "2d") if not strided(form) else ("2d",):
                dtype = DTYPES[(i * 5 + len(shape)) % len(DTYPES)]
                op = _ops(coll)[i % len(_ops(coll))]
                op = op if op is None or allowed(ReduceOp[op], dtype) else "SUM"
                add(Case(coll, form, dtype, op, shape, root=root, kind=KINDS[i % 2]))
        # Every dtype x op (reductions), every dtype (data movement), in rotating forms; on the thin
        # jobs every dtype with one op each, rotating (so every op still comes up).
        for j, dtype in enumerate(DTYPES if not thin or coll in REDUCING else FAMILIES):
            ops = [o for o in _ops(coll) if o is None or allowed(ReduceOp[o], dtype)]
            if thin:
                ops = [ops[j % len(ops)]]
            for k, op in enumerate(ops):
                form = forms[(j + k) % len(forms)]
                if strided(form):
                    form = forms[0]
                add(Case(coll, form, dtype, op, "1d", root=root, kind=KINDS[(j + k) % 2]))
        # Every shape; every size class on three dtypes, on the forms the fast path repeats.
        for shape in SHAPES:
            add(Case(coll, forms[0], "float64", "SUM" if coll in REDUCING else None, shape, root=root))
        for size in SIZES[1:]:
            if size == "slots" and coll not in slots:
                continue
            for dtype in ("uint8", "float32") if size != "slots" else ("float32",):
                for form in (forms[0], "out", "inplace") if size != "slots" else (forms[0],):
                    if form in forms:
                        op = "SUM" if coll in REDUCING else None
                        add(Case(coll, form, dtype, op, "1d", size, root=root))
            if coll in REDUCING and (size != "slots" or not thin):
                add(Case(coll, forms[0], "float64", "AVG", "2d", size, root=root))
        # Every group (and other roots on one of them).
        for group in GROUPS[1:]:
            members = len(group_ranks(group, n))
            if n < 2 or members == n:
                continue
            groot = None if root is None else members - 1
            add(Case(coll, forms[0], "int32", "MAX" if coll in REDUCING else None, "1d", root=groot, group=group))
            add(Case(coll, forms[0], "float32", "SUM" if coll in REDUCING else None, "1d", "step", groot, group))
        if root is not None and n > 2:
            add(Case(coll, forms[0], "int64", "SUM" if coll in REDUCING else None, "2d", root=0))
    for case in itertools.chain(errors(n), mismatches(n, transport)):  # whole (not valid calls by design)
        chosen.setdefault(case.describe(), case)
    for case in single_host(n, transport):
        chosen.setdefault(case.describe(), case)
    return list(chosen.values())


def generate(n: int, transport: str, level: str) -> list[Case]:
    """The cases for a job of ``n`` ranks on ``transport`` at ``level``: "ci", "full", or "quick" (the
    CI slice's thin table, torch tensors on shared memory only: what scripts/mutation.py runs per mutant)."""
    if level == "full":
        return list(full_product(n, transport))
    return ci_slice(n, transport, quick=level == "quick")


def interleave(cases: list[Case], seed: int, window: int = 8) -> list[list[Case]]:
    """``cases`` in a seeded random order, cut in windows: each window's calls repeat and interleave
    (rep 0 of every case, then rep 1, ...), so calls of one shape meet other calls between repeats."""
    order = list(cases)
    rng = np.random.default_rng(seed)
    rng.shuffle(order)  # type: ignore[arg-type]
    return [order[i : i + window] for i in range(0, len(order), window)]
