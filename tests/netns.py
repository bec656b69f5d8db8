"""Two "machines" on this one: two network namespaces joined by a veth pair, for the tests and the
benchmark of running across machines (tests/test_several_machines.py, benchmarks/several_machines.py).

Each namespace has its own network stack: an interface ``veth0`` (10.77.<n>.1 in the first, .2 in
the second) and its own loopback, so a rank in one reaches a rank in the other only through the
veth pair, as over a cable. hydra (MPICH's mpiexec) starts the second machine's ranks through a
"remote shell" that enters its namespace (``ip netns exec``) instead of ssh: ``-launcher ssh
-launcher-exec nsexec``. MPICH's UCX would still pass messages between the namespaces through shared
memory (they share /dev/shm), so ``UCX_TLS=tcp,self`` and ``UCX_NET_DEVICES=veth0`` send them
over TCP on the veth pair: what crosses it is counted by the interface's byte counters.

Needs root and ``ip``; :class:`Unavailable` says why not where they are missing.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

NSEXEC = """#!/bin/sh
# hydra's remote shell for two network namespaces: {nsexec} [-x] HOST COMMAND
[ "$1" = "-x" ] && shift
host=$1; shift
case "$host" in {a_ip}) ns={a} ;; {b_ip}) ns={b} ;; *) echo "nsexec: unknown host $host" >&2; exit 1 ;; esac
exec ip netns exec "$ns" sh -c "$*"
"""
TCP_ONLY = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "veth0"}
"""What keeps UCX off shared memory between the namespaces: TCP over the veth pair."""


class Unavailable(Exception):
    """Network namespaces cannot be made here (not root, no ``ip``, or the kernel refused)."""


@dataclass
class TwoMachines:
    a: str  # the namespaces' names
    b: str
    a_ip: str
    b_ip: str
    nsexec: Path  # hydra's -launcher-exec

    def hydra_args(self) -> list:
        """mpiexec's options that start ranks in both namespaces."""
        return ["-launcher", "ssh", "-launcher-exec", str(self.nsexec)]

    def hostfile(self, path: Path, slots: int | None = 2) -> Path:
        """A hydra hostfile of the two machines, ``slots`` ranks each (None: no slots given, so
        ``-ppn`` decides)."""
        suffix = "" if slots is None else f":{slots}"
        path.write_text(f"{self.a_ip}{suffix}\n{self.b_ip}{suffix}\n")
        return path

    def received_bytes(self, namespace: str) -> int:
        """Bytes received so far on ``namespace``'s veth0."""
        return int(run("ip", "netns", "exec", namespace, "cat", "/sys/class/net/veth0/statistics/rx_bytes"))

    def limit_rate(self, rate: str) -> None:
        """Cap each end of the pair at ``rate`` (``"1gbit"``: tc's token bucket filter), as a slower
        network between machines would be (the kernel here has no netem to add latency)."""
        for ns in (self.a, self.b):
            run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "veth0", "root", "tbf", "rate", rate,
                "burst", "256kb", "latency", "100ms")

    def command(self, *argv) -> list:
        """``argv`` run in the first namespace, where mpiexec starts."""
        return ["ip", "netns", "exec", self.a, *map(str, argv)]


def wait_until_up(namespace: str, seconds: float = 10.0) -> None:
    """Wait until ``veth0`` in ``namespace`` is operationally up (its carrier on); :class:`Unavailable` if
    it is not within ``seconds``. A condition polled, not a time assumed."""
    deadline = time.monotonic() + seconds
    while run("ip", "netns", "exec", namespace, "cat", "/sys/class/net/veth0/operstate").strip() != "up":
        if time.monotonic() > deadline:
            raise Unavailable(f"veth0 in {namespace} is not up after {seconds:.0f} s")
        time.sleep(0.05)


def run(*argv) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise Unavailable(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


@contextlib.contextmanager
def two_machines(folder: Path, subnet: int = 77):
    """Make two namespaces joined by a veth pair (``10.<subnet>.0.1`` and ``.2``), yield a
    :class:`TwoMachines`, and delete them on the way out."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise Unavailable("network namespaces need root and iproute2's ip")
    tag = f"md{os.getpid()}"
    m = TwoMachines(f"{tag}a", f"{tag}b", f"10.{subnet}.0.1", f"10.{subnet}.0.2", folder / "nsexec")
    made = []
    try:
        for ns in (m.a, m.b):
            run("ip", "netns", "add", ns)
            made.append(ns)
        run("ip", "link", "add", "veth0", "netns", m.a, "type", "veth", "peer", "name", "veth0", "netns", m.b)
        for ns, ip in ((m.a, m.a_ip), (m.b, m.b_ip)):
            run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "veth0")
            run("ip", "-n", ns, "link", "set", "veth0", "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")
        for ns in (m.a, m.b):  # the pair carries once both ends are up: UCX skips a device that does not yet
            wait_until_up(ns)  # (it failed once so: "network device 'veth0' is not available")
        m.nsexec.write_text(NSEXEC.format(nsexec=m.nsexec.name, a=m.a, b=m.b, a_ip=m.a_ip, b_ip=m.b_ip))
        m.nsexec.chmod(0o755)
        yield m
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth pair, and with it the pair
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
