"""Prefill and decode in separate network namespaces, joined by a veth pair, each with its own
address: gRPC and NIXL (UCX over TCP on the veth) between them, so nothing silently relies on
127.0.0.1 or on one host's loopback and shared-memory transports. Needs root and ``ip netns``;
skipped otherwise.

Then the link is cut (``ip link set down``) with a transfer published: decode declares the
stream lost (silence) and fails and settles the transfer within its bound."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import pytest

from tests import transfer_nodes
from tests.transfer_nodes import LEASE_S, WRITE_TIMEOUT_S, Cluster, Node

pytestmark = pytest.mark.netns

TOKENS = 16
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC = 0x4000
_MS_SLAVE = 1 << 19
_MNT_DETACH = 2


@dataclass(frozen=True)
class Side:
    ns: str
    dev: str
    addr: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture(scope="module")
def sides() -> Iterator[tuple[Side, Side]]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (ip netns)")
    tag = uuid.uuid4().hex[:6]
    p = Side(f"kvp-p-{tag}", f"vp{tag}", "10.77.0.1")
    d = Side(f"kvp-d-{tag}", f"vd{tag}", "10.77.0.2")
    try:
        _ip("netns", "add", p.ns)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"ip netns add failed: {exc.stderr.decode(errors='replace').strip()}")
    try:
        _ip("netns", "add", d.ns)
        _ip("link", "add", p.dev, "type", "veth", "peer", "name", d.dev)
        for s in (p, d):
            _ip("link", "set", s.dev, "netns", s.ns)
            _ip("-n", s.ns, "addr", "add", f"{s.addr}/24", "dev", s.dev)
            _ip("-n", s.ns, "link", "set", s.dev, "up")
            _ip("-n", s.ns, "link", "set", "lo", "up")
        yield p, d
    finally:
        for s in (p, d):
            with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
                _ip("netns", "del", s.ns)


def node_in_netns(conn: Connection, ns: str, addr: str, dev: str, target: str, *args: Any) -> None:
    """Runs ``transfer_nodes.<target>`` in namespace ``ns``: joined before any socket or thread
    exists, so every thread the node starts (gRPC, NIXL, UCX) lives there too."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise OSError(ctypes.get_errno(), what)

    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        check(libc.setns(fd, _CLONE_NEWNET), f"setns({ns})")
    finally:
        os.close(fd)
    # As `ip netns exec` does: a private mount namespace with /sys remounted, so /sys/class/net
    # (where UCX finds its devices) shows this namespace's interfaces.
    check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "make / a slave mount")
    check(libc.umount2(b"/sys", _MNT_DETACH), "umount /sys")
    check(libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None), "mount sysfs")
    os.environ.update(KVPUSH_TEST_HOST=addr, UCX_NET_DEVICES=dev, UCX_TLS="tcp")
    getattr(transfer_nodes, target)(conn, *args)


def _cluster(p: Side, d: Side, prefill_tp: int, decode_tp: int, tag: str) -> Cluster:
    pe, de = f"prefill-{tag}", f"decode-{tag}"
    prefill = [
        Node(node_in_netns, p.ns, p.addr, p.dev, "prefill_node", pe, r, prefill_tp, 256, "", WRITE_TIMEOUT_S)
        for r in range(prefill_tp)
    ]
    decode = Node(node_in_netns, d.ns, d.addr, d.dev, "decode_node", de, decode_tp, 256, "", 0.5)
    return Cluster(decode, prefill, pe, decode_tp, de)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)], ids=["p2-d1", "p1-d2"])
def test_transfers_across_namespaces_verify_byte_for_byte(
    sides: tuple[Side, Side], prefill_tp: int, decode_tp: int
) -> None:
    p, d = sides
    c = _cluster(p, d, prefill_tp, decode_tp, f"{prefill_tp}{decode_tp}")
    try:
        # Every endpoint either side advertises is its namespace's address.
        assert all(n.info["endpoint"].startswith(f"{p.addr}:") for n in c.prefill), [n.info for n in c.prefill]
        jobs = {"ns-contig": ([10, 11, 12, 13], [1, 2, 3, 4]), "ns-frag": ([90, 40, 41, 77], [9, 30, 31, 2])}
        for tid, (dst, src) in jobs.items():
            c.decode.call("reserve", tid, c.leg(tid), [dst], TOKENS, 0)
            c.done_all(tid, src, TOKENS)
        res = c.decode.call("wait", list(jobs), 30.0, timeout=40)
        assert res["ranks"] == {t: ("ok", "") for t in jobs}, res
        assert c.decode.call("verify", list(jobs.values())) == []
        assert c.decode.call("open") == 0
    finally:
        c.stop()


def test_cut_link_fails_and_settles_the_transfer_within_its_bound(sides: tuple[Side, Side]) -> None:
    p, d = sides
    c = _cluster(p, d, 1, 1, "cut")
    try:
        tid = "ns-cut"
        epoch = c.decode.call("reserve", tid, c.leg(tid), [[50, 51]], TOKENS, 0)
        assert c.prefill[0].call("wait_reservation", tid, epoch, 10.0, timeout=20) == epoch
        _ip("-n", d.ns, "link", "set", d.dev, "down")
        try:
            # Declared lost after two silent leases, then fenced by lease + write timeout + grace.
            bound = 2 * LEASE_S + LEASE_S + WRITE_TIMEOUT_S + 0.5
            res = c.decode.call("wait", [tid], bound + 10.0, timeout=bound + 20)
            assert res["settled"][tid] is not None and res["settled"][tid][0] == "failed", res
            assert "lost" in res["settled"][tid][1] or "silent" in res["settled"][tid][1], res
            assert c.decode.call("zero_blocks", [50, 51]) == [50, 51]  # nothing landed
            assert c.decode.call("open") == 0
        finally:
            _ip("-n", d.ns, "link", "set", d.dev, "up")
    finally:
        c.stop()
