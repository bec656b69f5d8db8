"""What a hostfile and the launcher's own arguments may say, checked before mpiexec or srun starts.

mpiexec reads a hostfile and its options without many checks of its own: MPICH's hydra spins at
100% CPU forever on ``localhost:-5`` and dies of a division by zero on ``localhost:0`` or ``-ppn 0``,
and answers ``localhost slots=2`` (Open MPI's spelling) with exit 255. So, here:

    a machine      an RFC 1123 host name: labels of 1 to 63 letters, digits and hyphens, not starting
                   or ending with a hyphen, dot-separated, 253 characters at most, the last one starting
                   with a letter (else ssh reads ``0`` or ``0x10`` as an address), or an IPv4 address;
                   and a name this machine resolves (mpiexec reaches it from here)
    a slot count   a whole number from 1 to :data:`MAX_SLOTS`, written in decimal digits only
    a hostfile     one machine per line (``#`` starts a comment), in the flavour's own format:
                   MPICH's hydra ``host`` or ``host:N`` with hydra's options ``user=NAME``,
                   ``binding=SPEC``; Open MPI's ``host`` with ``slots=N``, ``max_slots=N`` (or
                   ``max-slots``), ``user=NAME``
    the launcher's arguments (``--launcher-args``)
                   mpiexec: no ``-n`` / ``-np`` (the ranks are ``minidist.run -n``); ``-ppn N``,
                   ``-perhost N``, ``--npernode N`` a slot count; ``--host`` / ``-hosts`` a comma list
                   of machines, each with an optional ``:N`` slot count; ``-f`` / ``--hostfile`` /
                   ``-machinefile`` a hostfile as above. srun: no ``-n`` / ``--ntasks``;
                   ``--ntasks-per-node N`` a slot count. Any other argument goes to the launcher
                   unchecked: its meaning depends on the MPI and its version (binding, environment,
                   network options), and checking it would mean writing mpiexec again; if mpiexec
                   refuses it, it does so before it starts anything, and the launcher does not retry
                   that (minidist/run.py).
"""
from __future__ import annotations

import functools
import ipaddress
import os
import re
import socket

from minidist.untrusted import Unreadable, read_bounded

MAX_SLOTS = 256
"""The most ranks one machine runs: the launcher's bound for a job kept on this machine
(``minidist.run``'s ``MAX_RANKS``), and for every machine a hostfile or ``--host`` names."""
HOSTFILE_BYTES = 1 << 20
"""The largest hostfile read: a line per machine, far more machines than any job here."""
LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
SLOTS = re.compile(r"[0-9]{1,4}")  # (then 1 to MAX_SLOTS)
OPTIONS = {  # each flavour's options on a hostfile line: name -> whether its value is a slot count
    "hydra": {"user": False, "binding": False},
    "openmpi": {"slots": True, "max_slots": True, "max-slots": True, "user": False},
}
EXAMPLE = {"hydra": "host:2", "openmpi": "host slots=2"}
RANKS = {"mpiexec": ("-n", "-np", "--n", "--np"), "srun": ("-n", "--ntasks")}
SLOT_FLAGS = {"mpiexec": ("-ppn", "--ppn", "-perhost", "-npernode", "--npernode"), "srun": ("--ntasks-per-node",)}
HOST_FLAGS = ("-host", "--host", "-hosts", "--hosts")
HOSTFILE_FLAGS = ("-f", "-hostfile", "--hostfile", "-machinefile", "--machinefile", "--machine-file")


def host_problem(name: str) -> str | None:
    """Why ``name`` is not a machine mpiexec can reach, or None: not an RFC 1123 host name, a last
    label that starts with a digit (``0``, ``0x10``, ``1e-300``: ssh reads a number as an address)
    unless the whole is an IPv4 address, or a name that does not resolve on this machine."""
    labels = name.split(".")
    if not 0 < len(name) <= 253 or not all(LABEL.fullmatch(label) for label in labels):
        return (f"{name[:80]!r} is not a host name (RFC 1123: dot-separated labels of 1 to 63 letters, digits "
                "and hyphens, not starting or ending with a hyphen)")
    if not labels[-1][0].isalpha() and not _ipv4(name):
        return f"{name!r} is not a host name (its last label starts with a digit) nor an IPv4 address"
    if not _resolves(name):
        return f"{name!r}: no such host (the name does not resolve on this machine)"
    return None


def _ipv4(name: str) -> bool:
    try:
        ipaddress.IPv4Address(name)
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=1024)
def _resolves(name: str) -> bool:
    try:
        socket.getaddrinfo(name, None)
    except (OSError, UnicodeError):  # socket.gaierror is an OSError
        return False
    return True


def slots_problem(text: str) -> str | None:
    """Why ``text`` is not a slot count (1 to :data:`MAX_SLOTS`, in decimal digits), or None."""
    if not SLOTS.fullmatch(text) or not 1 <= int(text) <= MAX_SLOTS:
        return f"{text[:40]!r} is not a number of slots from 1 to {MAX_SLOTS}"
    return None


def line_problem(line: str, flavour: str) -> str | None:
    """Why ``line`` (a comment stripped) is not one machine in ``flavour``'s format ("hydra" or
    "openmpi"), or None."""
    first, *options = line.split()
    host, colon, slots = first.partition(":") if flavour == "hydra" else (first, "", "")
    problem = host_problem(host) or (slots_problem(slots) if colon else None)
    for option in options:
        if problem:
            break
        key, _, value = option.partition("=")
        if not value or key not in OPTIONS[flavour]:
            problem = (f"{option[:40]!r} is not an option {flavour} reads on a hostfile line "
                       f"({', '.join(k + '=' for k in OPTIONS[flavour])})")
        elif OPTIONS[flavour][key]:
            problem = slots_problem(value)
    return problem


def hostfile_problem(path: str, flavour: str, flag: str = "--hostfile") -> str | None:
    """What is wrong with ``path`` (given to ``flag``) as a hostfile of ``flavour`` ("openmpi", else
    hydra's format), or None: not a readable regular file, over :data:`HOSTFILE_BYTES` (read through
    minidist/untrusted.py), not UTF-8 text, no machine in it, or a line that is not one machine
    (:func:`line_problem`), named by its number."""
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        return f"{flag} {path}: {'not a readable file' if os.path.exists(path) else 'no such file'}"
    try:
        lines = read_bounded(path, HOSTFILE_BYTES, "a list of machines").decode("utf-8").splitlines()
    except Unreadable as e:
        return f"{flag} {e}"
    except UnicodeDecodeError as e:
        return f"{flag} {path}: not readable as text ({e.__class__.__name__})"
    flavour = "openmpi" if flavour == "openmpi" else "hydra"
    machines = 0
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        problem = line_problem(line, flavour)
        if problem:
            return (f"{flag} {path}: line {number} is not a machine in {flavour}'s format ('{EXAMPLE[flavour]}'): "
                    f"{problem}")
        machines += 1
    return None if machines else f"{flag} {path}: no machine in it"


def names_machines(args: list) -> bool:
    """Whether launcher arguments ``args`` name machines (a host list or a hostfile): the job's ranks
    may then run elsewhere."""
    return any(a.partition("=")[0] in HOST_FLAGS + HOSTFILE_FLAGS for a in args)


def launcher_args_problem(args: list, launcher: str, flavour: str) -> str | None:
    """What is wrong with ``args`` (``--launcher-args``) for ``launcher`` ("mpiexec" or "srun") of
    ``flavour``, or None: the module docstring's checks, each value given as ``FLAG VALUE`` or
    ``FLAG=VALUE``."""
    i = 0
    while i < len(args):
        flag, eq, value = args[i].partition("=") if args[i].startswith("--") else (args[i], "", "")
        checked = flag in RANKS[launcher] + SLOT_FLAGS[launcher] or launcher == "mpiexec" and flag in HOST_FLAGS + HOSTFILE_FLAGS
        if not checked:
            i += 1
            continue
        if not eq:
            if i + 1 == len(args):
                return f"--launcher-args {flag} needs a value after it"
            value, i = args[i + 1], i + 1
        i += 1
        where = f"--launcher-args {flag} {value[:80]}"
        if flag in RANKS[launcher]:
            return f"{where}: the number of ranks is minidist.run's own -n (the launcher is given it)"
        if flag in SLOT_FLAGS[launcher]:
            problem = slots_problem(value)
        elif flag in HOST_FLAGS:
            problem = next(filter(None, (host_problem(h.partition(":")[0]) or (
                slots_problem(h.partition(":")[2]) if ":" in h else None) for h in value.split(","))), None)
        else:
            problem, where = hostfile_problem(value, flavour, flag), "--launcher-args"
        if problem:
            return f"{where}: {problem}"
    return None
