"""What a member tells a restarted coordinator so that its job can be rebuilt.

The members of a running job hold the truth a coordinator loses when it restarts: who they are
(rank, host, peer address, device, secret), which barriers they saw complete, which members left,
and the last job event they received. Each member re-registers with its own part, then restores the
groups it registered and the keys it wrote; the job is whole again when every member re-registered
(or the others were declared failed).
"""

from __future__ import annotations

from dataclasses import dataclass

from collsvc.server.state.common import Device, Member, MemberState


@dataclass(frozen=True, slots=True)
class Reregistration:
    """One member's account of a running job, sent to a coordinator that may have restarted.

    ``barriers`` holds ``(group, generation)`` of the highest barrier it saw complete in each series
    of a group; ``last_event_seq`` the number of the last Watch event it received.
    """

    rank: int
    secret: str
    incarnation: int
    world_size: int
    num_nodes: int
    host: str
    peer_address: str
    device: Device
    pid: int
    local_rank: int
    local_size: int
    node_rank: int
    barriers: tuple[tuple[str, int], ...] = ()
    left_ranks: tuple[int, ...] = ()
    last_event_seq: int = 0

    def fill(self, member: Member) -> None:
        """Copies what the member said about itself into its placeholder."""
        member.host = self.host
        member.peer_address = self.peer_address
        member.device = self.device
        member.pid = self.pid
        member.local_rank = self.local_rank
        member.local_size = self.local_size
        member.node_rank = self.node_rank
        member.registered = True


def placeholder(rank: int, now: float) -> Member:
    """A member of a rebuilt job until it re-registers; its heartbeat clock starts at ``now``."""
    return Member(
        arrival=rank,
        host="unknown",
        peer_address="",
        device=Device(),
        pid=0,
        requested_rank=rank,
        local_rank_hint=None,
        rank=rank,
        state=MemberState.ALIVE,
        last_heartbeat=now,
        registered=False,
    )
