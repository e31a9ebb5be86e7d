"""Network namespaces for multi-host tests on one machine (we run as root): two namespaces, each its own host with
its own address, joined by veth pairs. `netns_pair` skips the test when namespaces or veth pairs are not permitted.

    with netns_pair("pdP", "10.77.0") as (ns_a, ns_b, ip_a, ip_b): ...               # one veth pair a <-> b
    with netns_pair("rayH", "10.78.0", reach_from_host=True) as (...): ...          # a veth pair from each to a
                                                                                      bridge on this host (10.78.0.254)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def sh(*cmd: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _steps(ns: tuple[str, str], ips: tuple[str, str], suffix: str, subnet: str, bridge: bool) -> list[list[str]]:
    (ns_a, ns_b), (ip_a, ip_b) = ns, ips
    a, b = f"va{suffix}", f"vb{suffix}"
    steps = [["ip", "netns", "add", ns_b]]
    if bridge:  # each namespace's veth ends on a bridge of this host, which also gets an address there
        br = f"br{suffix}"
        steps += [["ip", "link", "add", br, "type", "bridge"], ["ip", "addr", "add", f"{subnet}.254/24", "dev", br],
                  ["ip", "link", "set", br, "up"]]
        for ns, dev in ((ns_a, a), (ns_b, b)):
            steps += [["ip", "link", "add", dev, "type", "veth", "peer", "name", f"h{dev}"],
                      ["ip", "link", "set", f"h{dev}", "master", br], ["ip", "link", "set", f"h{dev}", "up"],
                      ["ip", "link", "set", dev, "netns", ns]]
    else:
        steps += [["ip", "link", "add", a, "type", "veth", "peer", "name", b],
                  ["ip", "link", "set", a, "netns", ns_a], ["ip", "link", "set", b, "netns", ns_b]]
    for ns, dev, ip in ((ns_a, a, ip_a), (ns_b, b, ip_b)):
        steps += [["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev], ["ip", "-n", ns, "link", "set", dev, "up"],
                  ["ip", "-n", ns, "link", "set", "lo", "up"]]
    return steps


@contextmanager
def netns_pair(prefix: str, subnet: str, reach_from_host: bool = False) -> Iterator[tuple[str, str, str, str]]:
    """Namespaces {prefix}A ({subnet}.1) and {prefix}B ({subnet}.2) joined by a veth pair, or with
    `reach_from_host` by a veth pair each to a bridge on this host (so this host reaches both, at {subnet}.254).
    On exit every process left in them is ended and the namespaces are removed."""
    if shutil.which("ip") is None:
        pytest.skip("the `ip` tool is not installed")
    suffix = f"{prefix[:3]}{os.getpid() % 10000}"
    ns_a, ns_b = f"{prefix}A{suffix}", f"{prefix}B{suffix}"
    r = sh("ip", "netns", "add", ns_a)
    if r.returncode != 0:
        pytest.skip(f"`ip netns add` is not permitted here: {r.stderr.strip()}")
    try:
        for step in _steps((ns_a, ns_b), (f"{subnet}.1", f"{subnet}.2"), suffix, subnet, reach_from_host):
            r = sh(*step)
            if r.returncode != 0:
                pytest.skip(f"cannot set up the namespaces ({' '.join(step)}): {r.stderr.strip()}")
        yield ns_a, ns_b, f"{subnet}.1", f"{subnet}.2"
    finally:
        for ns in (ns_a, ns_b):
            end_processes(ns)
            sh("ip", "netns", "del", ns)  # removes its veth ends, and with them the pairs
        if reach_from_host:
            sh("ip", "link", "del", f"br{suffix}")


def end_processes(ns: str, grace: float = 5.0) -> None:
    """SIGTERM every process in namespace `ns` (they are this test's), SIGKILL those left after `grace` s."""
    def pids() -> list[int]:
        return [int(p) for p in sh("ip", "netns", "pids", ns).stdout.split()]

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
        for pid in pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids() and time.monotonic() < deadline:
            time.sleep(0.2)
