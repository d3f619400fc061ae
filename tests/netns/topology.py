"""Linux network namespaces as hosts: a switch namespace with a bridge, and one namespace per host.

Needs root (CI runs as root here). Every namespace and link is removed on exit, and names carry the
creating process id so parallel runs do not collide. Addresses live only inside these namespaces.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

SUBNET = "10.231.{}.{}"


def available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc)"
    probe = f"csvprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    if made.returncode:
        return f"cannot create network namespaces: {made.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def sh(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True)


@dataclass
class Host:
    name: str
    namespace: str
    address: str
    device: str = "eth0"
    switch: str = ""  # the switch namespace holding this host's bridge port
    port: str = ""  # this host's veth end on the bridge

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv]

    def limit(self, rate: str) -> None:
        """Caps this host's outgoing traffic with a token bucket (tc tbf)."""
        sh(
            *self.command(
                [
                    "tc",
                    "qdisc",
                    "replace",
                    "dev",
                    self.device,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    "256kb",
                    "latency",
                    "100ms",
                ]
            )
        )

    def unlimit(self) -> None:
        subprocess.run(self.command(["tc", "qdisc", "del", "dev", self.device, "root"]), capture_output=True)

    def cut(self) -> None:
        """Pulls this host's cable: its bridge port goes down, so nothing crosses in either direction.

        Neither side is told: no FIN, no RST, no ICMP. Packets are dropped silently, as on a failed
        switch port. The host's own interface keeps its address and routes.
        """
        sh("ip", "-n", self.switch, "link", "set", self.port, "down")

    def mend(self) -> None:
        """Plugs the cable back in (undoes :meth:`cut`)."""
        sh("ip", "-n", self.switch, "link", "set", self.port, "up")


def pin_neighbours(hosts: dict[str, Host]) -> None:
    """Gives every host permanent neighbour (ARP) entries for the others.

    Without them, a host whose peer vanished finds out locally within seconds: address resolution
    fails and its sockets get EHOSTUNREACH. With them, a cut is silent, as on a routed path whose
    gateway stays reachable: packets vanish and nothing reports it.
    """
    macs = {}
    for name, host in hosts.items():
        shown = subprocess.run(
            host.command(["ip", "-j", "link", "show", host.device]), check=True, capture_output=True, text=True
        )
        macs[name] = json.loads(shown.stdout)[0]["address"]
    for name, host in hosts.items():
        for other_name, other in hosts.items():
            if other_name != name:
                neighbour = ["ip", "neigh", "replace", other.address, "lladdr", macs[other_name]]
                sh(*host.command([*neighbour, "nud", "permanent", "dev", host.device]))


@contextlib.contextmanager
def hosts(names: list[str]) -> Iterator[dict[str, Host]]:
    """Creates one namespace per name, all on one bridge; yields them by name."""
    tag = os.getpid() % 100000
    subnet = tag % 250 + 1
    switch = f"csvsw{tag}"
    made: list[str] = []
    try:
        sh("ip", "netns", "add", switch)
        made.append(switch)
        sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", switch, "link", "set", "br0", "up")
        result: dict[str, Host] = {}
        for index, name in enumerate(names, start=1):
            namespace = f"csv{tag}{name}"[:15]
            sh("ip", "netns", "add", namespace)
            made.append(namespace)
            outside = f"v{tag}{index}"[:15]
            sh("ip", "link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            sh("ip", "link", "set", outside, "netns", switch)
            sh("ip", "-n", switch, "link", "set", outside, "master", "br0", "up")
            address = SUBNET.format(subnet, index)
            sh("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            sh("ip", "-n", namespace, "link", "set", "eth0", "up")
            sh("ip", "-n", namespace, "link", "set", "lo", "up")
            result[name] = Host(name, namespace, address, switch=switch, port=outside)
        yield result
    finally:
        for namespace in reversed(made):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
