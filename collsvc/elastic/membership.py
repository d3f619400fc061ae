"""Who is in an elastic job: generations of members agreed through the coordinator's key/value store.

Generation 0 is the job ``init()`` joined. Each later generation ``g`` is an ordinary collsvc
job named ``"{job}@{run}.g{g}"`` whose members were agreed on like this (keys under ``"{run}/g{g}/"`` in
the key/value store of the job ``"{job}@elastic"``, which nobody joins):

1. every surviving member of generation ``g-1`` writes ``alive/{its index}``, then waits for the
   ``alive`` keys of the members not known to have failed, for at most the *alive window*;
2. each proposes the members it saw, in their old order, followed by the newcomers waiting in the lobby;
   the first proposal stored (compare-and-set) is the plan, the same for everyone;
3. every member of the plan writes ``ready/{its position}`` and waits for the others' (bounded by the
   re-form timeout): a member that died after step 1 is found missing here; the first verdict stored
   (``verdict``, compare-and-set: the positions found missing) is everyone's;
4. all join generation ``g`` with ranks renumbered 0..n-1 in plan order.

An attempt that fails at step 3 or 4 (a member died during the re-form) starts over at ``g+1`` with the
plan's members, so a death during the re-form drops that member too. A survivor left out of a plan (it
arrived after the alive window) waits in the lobby like a newcomer. Newcomers take a ticket from the
lobby counter and wait until a plan admits them (``admitted/{ticket}``) or the job finishes.

``run`` is the hexadecimal incarnation of the generation-0 job, so a later job reusing the name on the
same coordinator never reads this one's keys. Every member of generation 0 stores it under the key
``run``: its presence tells a process restarted with its first environment that the job started
(:func:`started`, used by ``python -m collsvc.elastic.rejoin``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from collsvc import config
from collsvc._api import default_communicator, destroy, init_with, is_initialized
from collsvc.client.communicator import Communicator
from collsvc.client.rendezvous import CoordinatorClient
from collsvc.errors import CollectiveTimeoutError, RendezvousError
from collsvc.options import InitOptions
from collsvc.types import ReduceOp

log = logging.getLogger(__name__)

JOIN_ENV = "COLLSVC_ELASTIC_JOIN"  # set on a newcomer: the elastic job (generation-0 job id) to join
_FINISHED = b"finished"
_RUN_KEY = "run"  # the run id, set once generation 0 formed


@dataclass
class Plan:
    """The members of one generation, in rank order.

    Attributes:
        members: ``("member", index in the previous generation)`` or ``("newcomer", ticket)`` per rank.
        has_state: per rank, whether it holds training state (newcomers do not until the broadcast).
        admitted: the lobby tickets up to this one are admitted (in this or an earlier generation).
    """

    members: list[tuple[str, int]]
    has_state: list[bool]
    admitted: int

    def encode(self) -> bytes:
        return json.dumps({"members": self.members, "has_state": self.has_state, "admitted": self.admitted}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Plan:
        data = json.loads(raw)
        return cls([(str(kind), int(n)) for kind, n in data["members"]], list(data["has_state"]), int(data["admitted"]))


@dataclass
class Membership:
    """This process's place in an elastic job, and the re-form protocol (see the module docstring).

    Attributes:
        options: the options generation 0 was joined with (coordinator, token, backend, timeout).
        base: the generation-0 job id.
        run: the run id (hexadecimal incarnation of the generation-0 job).
        control: the key/value client of the job ``"{base}@elastic"`` (lobby and agreements).
        generation: the current generation.
        index: this process's rank in the current generation, None while it waits in the lobby.
        ticket: this process's lobby ticket while it is a newcomer.
        size: members in the current generation.
        admitted: lobby tickets up to this one were admitted.
        has_state: whether this process holds training state.
        state_source: the rank of the current generation that broadcasts the state.
        reform_timeout: seconds one re-form attempt may take.
    """

    options: InitOptions
    base: str
    run: str
    control: CoordinatorClient
    generation: int = 0
    index: int | None = 0
    ticket: int = 0
    size: int = 1
    admitted: int = 0
    has_state: bool = True
    state_source: int = 0
    reform_timeout: float = config.DEFAULT_ELASTIC_REFORM_TIMEOUT

    # -- starting ------------------------------------------------------------------------------------

    @classmethod
    def start(cls) -> tuple[Membership, Communicator | None]:
        """This process's membership from the default communicator, and the communicator to train on.

        A newcomer (``COLLSVC_ELASTIC_JOIN`` set) leaves the stand-in job it joined, waits in the lobby
        of the named elastic job and joins the generation that admits it; it gets None when that job
        finishes first.

        Raises:
            CollsvcError: ``init()`` was not called.
            RendezvousError: a newcomer was not admitted within the job's timeout, or the re-form failed.
        """
        comm = default_communicator()
        options = comm.job.options
        # Reads the environment itself: COLLSVC_ELASTIC_JOIN is written by the elastic launcher and rejoin for
        # a newcomer.
        reform_timeout = config.elastic_reform_timeout()
        joining = os.environ.get(JOIN_ENV)
        if joining:
            base = joining
            control = _control_client(options, base)
            destroy()  # the stand-in job init() joined
            run = control.get(_RUN_KEY, options.timeout).decode()
            membership = cls(options, base, run, control, index=None, has_state=False, reform_timeout=reform_timeout)
            return membership, membership.reform(set())
        base = options.job_id
        run = f"{comm.job.incarnation:x}"
        control = _control_client(options, base)
        # Every member says the job started (same value): a restarted member asks before it joins.
        control.set(_RUN_KEY, run.encode())
        membership = cls(options, base, run, control, size=comm.size, index=comm.rank, reform_timeout=reform_timeout)
        return membership, comm

    # -- newcomers at commit -------------------------------------------------------------------------

    def newcomers_waiting(self, comm: Communicator) -> bool:
        """Whether newcomers wait in the lobby, agreed by every rank of ``comm`` (a collective).

        Raises:
            RankFailedError / CollectiveTimeoutError: from the one-element all_reduce.
        """
        waiting = 0
        if comm.rank == 0:
            waiting = self.control.add(self._key("newcomers"), 0) - self.admitted
        agreed = comm.all_reduce(np.array([waiting], dtype=np.int64), ReduceOp.MAX)
        return int(agreed[0]) > 0

    def finish(self, comm: Communicator) -> None:
        """Tells newcomers still waiting that the job is over (rank 0 of the final generation)."""
        if comm.rank != 0:
            return
        self.control.add(self._key("finished"), 1)
        count = self.control.add(self._key("newcomers"), 0)
        for ticket in range(self.admitted + 1, count + 1):
            self.control.set(self._key(f"admitted/{ticket}"), _FINISHED)

    # -- re-forming ----------------------------------------------------------------------------------

    def reform(self, failed: set[int]) -> Communicator | None:
        """Leaves the current generation and joins the next one that includes this process.

        Args:
            failed: ranks of the current generation known to have failed (they are not waited for).

        Returns:
            The communicator of the new generation (also the default one), or None when this process
            was a newcomer and the job finished before admitting it.

        Raises:
            RendezvousError: no generation formed within the job's timeout (``init(timeout=...)``).
        """
        if is_initialized():
            destroy()
        give_up = time.monotonic() + self.options.timeout
        while time.monotonic() < give_up:
            if self.index is None:
                admission = self._await_admission(give_up)
                if admission is None:
                    return None
                generation, plan = admission
                position = plan.members.index(("newcomer", self.ticket))
                self.ticket = 0  # used up: leaving a later plan takes a new one
            else:
                generation = self.generation + 1
                plan = self._agree(generation, failed)
                if ("member", self.index) not in plan.members:
                    log.warning(
                        "job %s generation %d: left out of the new membership; waiting to be admitted again",
                        self.base,
                        generation,
                    )
                    self._enter_lobby()
                    continue
                position = plan.members.index(("member", self.index))
            self._adopt(generation, plan, position)
            missing = self._ready(generation, plan, position)
            if missing:
                log.warning(
                    "job %s generation %d: ranks %s did not get ready; re-forming without them",
                    self.base,
                    generation,
                    sorted(missing),
                )
                failed = missing
                continue
            try:
                # Every member said it is ready; one that dies now is missed at the join, which then
                # waits no longer than a re-form may take (not the job's timeout) before re-forming.
                comm = init_with(
                    dataclasses.replace(
                        self.options,
                        world_size=len(plan.members),
                        rank=position,
                        job_id=f"{self.base}@{self.run}.g{generation}",
                        join_timeout=min(self.reform_timeout, self.options.timeout),
                    )
                )
            except RendezvousError as exc:
                log.warning("job %s generation %d: join failed (%s); re-forming", self.base, generation, exc)
                failed = set()
                continue
            log.info(
                "job %s generation %d: rank %d of %d (state from rank %d)",
                self.base,
                generation,
                comm.rank,
                comm.size,
                self.state_source,
            )
            return comm
        raise RendezvousError(
            f"elastic job {self.base!r}: no new membership formed within {self.options.timeout:g}s "
            f"(generation {self.generation})"
        )

    def _key(self, name: str) -> str:
        return f"{self.run}/{name}"

    def _agree(self, generation: int, failed: set[int]) -> Plan:
        """Steps 1 and 2: announce this member alive, see who else is, and agree on the plan."""
        assert self.index is not None
        prefix = f"g{generation}"
        self.control.set(self._key(f"{prefix}/alive/{self.index}"), b"1" if self.has_state else b"0")
        log.info("job %s generation %d: member %d is alive", self.base, generation, self.index)
        window_end = time.monotonic() + self.alive_window
        alive = {self.index: self.has_state}
        for index in range(self.size):
            if index in failed or index in alive:
                continue
            try:
                value = self.control.get(
                    self._key(f"{prefix}/alive/{index}"), max(window_end - time.monotonic(), 0.001)
                )
            except CollectiveTimeoutError:
                continue
            alive[index] = value == b"1"
        count = self.control.add(self._key("newcomers"), 0)
        newcomers = list(range(self.admitted + 1, count + 1))
        proposal = Plan(
            [("member", index) for index in sorted(alive)] + [("newcomer", ticket) for ticket in newcomers],
            [alive[index] for index in sorted(alive)] + [False] * len(newcomers),
            max(count, self.admitted),
        )
        plan = Plan.decode(self._compare_set(self._key(f"{prefix}/plan"), proposal.encode()))
        for kind, ticket in plan.members:
            if kind == "newcomer":  # every member says so: the admission survives any one of them dying
                self.control.set(self._key(f"admitted/{ticket}"), str(generation).encode())
        return plan

    @property
    def alive_window(self) -> float:
        """Seconds to wait for the other survivors to announce themselves."""
        return self.reform_timeout / 3

    def _compare_set(self, key: str, desired: bytes) -> bytes:
        """Stores ``desired`` under ``key`` unless something is there; returns what is stored."""
        return self.control.compare_set(key, desired)

    def _ready(self, generation: int, plan: Plan, position: int) -> set[int]:
        """Step 3: the positions in ``plan`` that did not say ready within the re-form timeout.

        Members may disagree (one said ready just after another stopped waiting for it), so the first
        verdict stored (compare-and-set) is everyone's: either all join the generation or none does.
        """
        prefix = f"g{generation}"
        self.control.set(self._key(f"{prefix}/ready/{position}"), b"1")
        deadline = time.monotonic() + self.reform_timeout
        missing: set[int] = set()
        for other in range(len(plan.members)):
            if other == position:
                continue
            try:
                self.control.get(self._key(f"{prefix}/ready/{other}"), max(deadline - time.monotonic(), 0.001))
            except CollectiveTimeoutError:
                missing.add(other)
        verdict = self._compare_set(self._key(f"{prefix}/verdict"), json.dumps(sorted(missing)).encode())
        return {int(rank) for rank in json.loads(verdict)}

    def _adopt(self, generation: int, plan: Plan, position: int) -> None:
        self.generation = generation
        self.index = position
        self.size = len(plan.members)
        self.admitted = max(self.admitted, plan.admitted)
        sources = [rank for rank, has in enumerate(plan.has_state) if has]
        if not sources:
            raise RendezvousError(
                f"elastic job {self.base!r} generation {generation}: no member holds the training state "
                "(every member that had it failed)"
            )
        self.state_source = sources[0]

    def _enter_lobby(self) -> None:
        self.index = None
        self.ticket = self.control.add(self._key("newcomers"), 1)
        log.info("job %s: waiting in the lobby with ticket %d", self.base, self.ticket)

    def _await_admission(self, give_up: float) -> tuple[int, Plan] | None:
        """Waits until a plan admits this newcomer: (generation, plan), or None when the job finished."""
        if not self.ticket:
            self._enter_lobby()
        if self.control.add(self._key("finished"), 0):
            return None
        key = self._key(f"admitted/{self.ticket}")
        while True:
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                raise RendezvousError(
                    f"elastic job {self.base!r}: not admitted within {self.options.timeout:g}s "
                    f"(lobby ticket {self.ticket}); the members admit newcomers at state.commit()"
                )
            try:
                value = self.control.get(key, remaining)
            except CollectiveTimeoutError:
                continue
            if value == _FINISHED:
                log.info("job %s: finished before admitting lobby ticket %d", self.base, self.ticket)
                return None
            generation = int(value)
            plan = Plan.decode(self.control.get(self._key(f"g{generation}/plan"), max(remaining, 0.001)))
            return generation, plan


def started(options: InitOptions) -> bool:
    """Whether the elastic job ``options.job_id`` already started on ``options.coordinator``.

    A process restarted with the environment it first had (a Kubernetes Indexed Job's new pod for a
    failed index) must then join as a newcomer: the members re-formed without it, and the generation
    0 that its environment names is gone. Waits for the coordinator to answer, up to the join timeout.

    Raises:
        RendezvousError: the coordinator did not answer in time.
        AuthenticationError: the coordinator refused the token.
    """
    control = _control_client(options, options.job_id)
    try:
        return control.lookup(_RUN_KEY, options.join_timeout or options.timeout) is not None
    finally:
        control.close()


def _control_client(options: InitOptions, base: str) -> CoordinatorClient:
    return CoordinatorClient(
        options.coordinator, f"{base}@elastic", token=options.token, tls=options.tls, timeout=options.timeout
    )
