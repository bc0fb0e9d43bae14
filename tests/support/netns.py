"""A real MTU on one machine: two network namespaces the test makes, joined by a veth pair (FACTS.md, "A real MTU").

:func:`veth_pair` makes them (root; ``ip netns add``, a veth pair, addresses of the benchmarking range 198.18.0.0/15,
which only these namespaces see) and removes them afterwards; where namespaces cannot be made (not root, no
``ip``, a container without CAP_SYS_ADMIN) the test is skipped and says why. :attr:`VethPair.exec` runs a command in
one of them (``ip netns exec NS``), and :meth:`VethPair.ip_counters` reads a namespace's IP counters from
``/proc/net/snmp`` as seen inside it: ``FragCreates`` counts the IP fragments its senders made.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

_NAMES = itertools.count()
IP = shutil.which("ip")


@dataclass(frozen=True)
class VethPair:
    """Namespace *a* (address :attr:`a_ip`) and namespace *b* (:attr:`b_ip`), one veth link of *mtu* octets."""

    a: str
    b: str
    mtu: int
    a_ip: str = "198.18.0.1"
    b_ip: str = "198.18.0.2"

    @staticmethod
    def exec(ns: str) -> tuple[str, ...]:
        """The prefix that runs a command in *ns* (it execs the command: same process)."""
        assert IP is not None
        return (IP, "netns", "exec", ns)

    def ip_counters(self, ns: str) -> dict[str, int]:
        """The ``Ip:`` counters of ``/proc/net/snmp`` inside *ns* (FragCreates, FragOKs, ReasmReqds, ...)."""
        return snmp(ns)["Ip"]


def snmp(ns: str) -> dict[str, dict[str, int]]:
    """``/proc/net/snmp`` read inside namespace *ns*: {"Ip": {"FragCreates": n, ...}, "Udp": {...}, ...}."""
    assert IP is not None
    text = subprocess.run([IP, "netns", "exec", ns, "cat", "/proc/net/snmp"], check=True, capture_output=True,
                          text=True, timeout=10).stdout
    lines = text.splitlines()
    table: dict[str, dict[str, int]] = {}
    for head, values in zip(lines[::2], lines[1::2], strict=False):
        proto, _, names = head.partition(":")
        _, _, numbers = values.partition(":")
        table[proto] = {n: int(v) for n, v in zip(names.split(), numbers.split(), strict=True)}
    return table


def _ip(*args: str) -> None:
    assert IP is not None
    done = subprocess.run([IP, *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")


@contextmanager
def veth_pair(mtu: int) -> Iterator[VethPair]:
    """Two fresh namespaces joined by a veth pair of *mtu* octets (loopback up in both); removed on exit. Skips
    the test, with the reason, where they cannot be made."""
    if IP is None:
        pytest.skip("network namespaces: iproute2's ip is not installed (apt-get install iproute2)")
    if os.geteuid() != 0:
        pytest.skip("network namespaces: making them needs root")
    n = next(_NAMES)
    tag = f"{os.getpid() % 100000}x{n}"
    pair = VethPair(f"kvsp-{tag}-a", f"kvsp-{tag}-b", mtu)
    made: list[str] = []
    try:
        for ns in (pair.a, pair.b):
            _ip("netns", "add", ns)
            made.append(ns)
        va, vb = f"kv{tag}a", f"kv{tag}b"  # interface names: 15 characters at most
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", pair.a)
        _ip("link", "set", vb, "netns", pair.b)
        for ns, dev, addr in ((pair.a, va, pair.a_ip), (pair.b, vb, pair.b_ip)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "mtu", str(mtu), "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except OSError as exc:
        for ns in made:
            subprocess.run([IP, "netns", "del", ns], capture_output=True, timeout=10)
        pytest.skip(f"network namespaces cannot be made here: {exc}")
    try:
        yield pair
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run([IP, "netns", "del", ns], capture_output=True, timeout=10)
