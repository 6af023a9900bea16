"""The Internet sockets of a set of processes, read from ``/proc`` (Linux): which address each listens or connects
on, so that a test can show a Ray cluster of its own keeps to 127.0.0.1 (tests/test_cluster_loopback.py,
tests/test_parity_address.py)."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

#: ``/proc/net/tcp`` state codes (include/net/tcp_states.h).
TCP_LISTEN = "0A"
TCP_CLOSE = "07"


@dataclass(frozen=True)
class Sock:
    """One Internet socket of a process: the table it is in (``tcp``, ``tcp6``, ``udp``, ``udp6``), its local and
    remote address (``ip``, ``port``), its state code and the process's id and name."""

    table: str
    local: tuple[str, int]
    remote: tuple[str, int]
    state: str
    pid: int
    name: str

    def __str__(self) -> str:
        kind = "listens on" if self.state == TCP_LISTEN and self.table.startswith("tcp") else "uses"
        far = "" if self.remote[1] == 0 else f" to {self.remote[0]}:{self.remote[1]}"
        return f"{self.name} ({self.pid}) {kind} {self.table} {self.local[0]}:{self.local[1]}{far}"


def _address(hexed: str) -> tuple[str, int]:
    """``/proc/net/{tcp,udp}{,6}``'s ``HEXIP:HEXPORT`` (each 32-bit word in host byte order) as ``(ip, port)``."""
    ip_hex, port_hex = hexed.split(":")
    raw = b"".join(bytes.fromhex(ip_hex[i:i + 8])[::-1] for i in range(0, len(ip_hex), 8))
    a = ipaddress.ip_address(raw)
    mapped = getattr(a, "ipv4_mapped", None)  # an IPv6 socket's IPv4 peer: ::ffff:a.b.c.d
    return (f"::ffff:{mapped}" if mapped is not None else str(a)), int(port_hex, 16)


def _inodes(pid: int) -> set[int]:
    """The socket inodes among ``pid``'s open files (``socket:[N]`` links); empty when the process is gone."""
    out = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def inet_sockets(pids: list[int]) -> list[Sock]:
    """Every TCP and UDP socket (IPv4 and IPv6) held by one of ``pids`` (Unix sockets are not listed)."""
    owner = {}
    for pid in pids:
        for inode in _inodes(pid):
            owner.setdefault(inode, pid)
    out = []
    for table in ("tcp", "tcp6", "udp", "udp6"):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            inode = int(f[9])
            if inode in owner:
                out.append(Sock(table, _address(f[1]), _address(f[2]), f[3], owner[inode], _name(owner[inode])))
    return out


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8 or ::1, also written as an IPv4-mapped IPv6 address (``::ffff:127.0.0.1``)."""
    a = ipaddress.ip_address(ip)
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        a = a.ipv4_mapped
    return a.is_loopback


def off_loopback(socks: list[Sock]) -> list[str]:
    """The sockets of ``socks`` bound or connected anywhere but the loopback: a listening socket on another address
    or on every address (``0.0.0.0``, ``::``), a connection with either end elsewhere."""
    bad = []
    for s in socks:
        unbound_udp = s.table.startswith("udp") and s.local[1] == 0
        if not unbound_udp and not is_loopback(s.local[0]):
            bad.append(str(s))
        elif s.remote[1] != 0 and not is_loopback(s.remote[0]):
            bad.append(str(s))
    return bad
