"""Which local user is on the other end of a connection.

Shared memory lets a caller make the gateway open an object on this host with the gateway's
rights, and anonymous callers on this host are told apart by their user: the gateway must
therefore know which user asks (Note [region owners] in :mod:`trims.runtime.gateway.oip_shm`,
the per-uid connection caps in :mod:`trims.runtime.gateway.connections`). Over a Unix socket
the kernel says (``SO_PEERCRED``). Over TCP the kernel's socket table says: the caller's socket
is the one whose local address is the connection's peer address and whose remote address is
ours (what identd does), and the table lists the uid that owns each socket.

The gateway asks the kernel for exactly that socket with one sock_diag netlink request
(``SOCK_DIAG_BY_FAMILY`` naming the four-tuple: the kernel looks it up in its connection hash
table), so the answer costs the same ~25 us with 100 or 8,000 sockets open: the connection
guard asks it for every loopback connection it accepts. Where netlink is refused (a seccomp
profile, a kernel without inet_diag) it reads the table of the address's family from
``/proc/net`` instead, whose text the kernel writes out in full on every read: ~18 ms with
8,000 sockets open. Anything else has no local user: None.
"""

from __future__ import annotations

import errno
import ipaddress
import re
import socket
import struct
from typing import Any

__all__ = ["is_loopback", "peer_of", "peer_uid"]

_UCRED = struct.Struct("3i")  # pid, uid, gid

Address = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]

# linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_NLMSG = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
#: inet_diag_req_v2 up to its socket id: family, protocol, ext, pad, states.
_REQ = struct.Struct("=BBBBI")
#: inet_diag_sockid: sport, dport, src, dst (network order), then if and cookie (host order).
_SOCKID_ADDRS = struct.Struct("!HH16s16s")
_SOCKID_TAIL = struct.Struct("=III")
#: inet_diag_msg: family, state, timer, retrans, sockid (48 bytes), expires, rqueue, wqueue,
#: then the uid.
_MSG_UID = struct.Struct("=I")
_MSG_UID_AT = _NLMSG.size + 4 + 48 + 12


def peer_uid(transport: Any) -> int | None:
    """The uid of the process on the other end of ``transport`` (an asyncio transport), or
    None when it is not a local connection or the kernel does not say."""
    if transport is None:
        return None
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    if sock.family == socket.AF_UNIX:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        return int(_UCRED.unpack(raw)[1])
    peer, local = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
    if not peer or not local:
        return None
    return _tcp_owner((_ip(peer[0]), int(peer[1])), (_ip(local[0]), int(local[1])))


def peer_of(transport: Any) -> str:
    """Who is on the other end of ``transport``, as per-peer limits count callers: ``uid <n>``
    for a local caller whose user the kernel says (loopback or a Unix socket), else the peer's
    address (Note [connection peers] in :mod:`trims.runtime.gateway.connections`)."""
    peername = transport.get_extra_info("peername")
    address = str(peername[0]) if isinstance(peername, tuple) else ""
    if not is_loopback(address):
        return address
    uid = peer_uid(transport)
    if uid is None:
        return address or "unix"
    return f"uid {uid}"


def is_loopback(remote: str) -> bool:
    """Whether a peer address is on this host: loopback (IPv4-mapped too), or "" for a Unix
    socket (aiohttp's ``request.remote`` there)."""
    if remote == "":
        return True
    try:
        address = _ip(remote)
    except ValueError:
        return False
    return address.is_loopback


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    address = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _tcp_owner(peer: Address, local: Address) -> int | None:
    """The uid owning the TCP socket whose local address is ``peer`` and remote ``local``."""
    try:
        return _diag_owner(peer, local)
    except OSError:
        return _table_owner(peer, local)


def _diag_owner(peer: Address, local: Address) -> int | None:
    """One sock_diag request for the socket (``peer`` -> ``local``); OSError when netlink is
    refused."""
    family = socket.AF_INET if peer[0].version == 4 else socket.AF_INET6
    sockid = _SOCKID_ADDRS.pack(
        peer[1], local[1], peer[0].packed.ljust(16, b"\0"), local[0].packed.ljust(16, b"\0")
    ) + _SOCKID_TAIL.pack(0, _INET_DIAG_NOCOOKIE, _INET_DIAG_NOCOOKIE)
    body = _REQ.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    header = _NLMSG.pack(_NLMSG.size + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.send(header + body)
        reply = nl.recv(8192)
    kind = _NLMSG.unpack_from(reply)[1]
    if kind == _SOCK_DIAG_BY_FAMILY and len(reply) >= _MSG_UID_AT + _MSG_UID.size:
        return int(_MSG_UID.unpack_from(reply, _MSG_UID_AT)[0])
    if kind == _NLMSG_ERROR:
        code = -struct.unpack_from("=i", reply, _NLMSG.size)[0]
        if code == errno.ENOENT:
            return None
        raise OSError(code, f"sock_diag lookup failed: {errno.errorcode.get(code, code)}")
    return None


def _table_owner(peer: Address, local: Address) -> int | None:
    """The owner from ``/proc/net/tcp`` (IPv4; then ``tcp6``, where a dual-stack client's
    socket lists the address IPv4-mapped) or ``tcp6`` (IPv6)."""
    if peer[0].version == 4:
        mapped = (ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + peer[0].packed), peer[1])
        local6 = (ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + local[0].packed), local[1])
        tables = [("/proc/net/tcp", peer, local), ("/proc/net/tcp6", mapped, local6)]
    else:
        tables = [("/proc/net/tcp6", peer, local)]
    for table, ours, theirs in tables:
        try:
            with open(table) as f:
                text = f.read()
        except OSError:
            continue
        row = re.search(
            rf"^\s*\d+: {_encode(ours)} {_encode(theirs)} (?:\S+\s+){{4}}(\d+)", text, re.M
        )
        if row is not None:
            return int(row.group(1))
    return None


def _encode(address: Address) -> str:
    """(ip, port) -> the kernel's ``0100007F:1F90`` (each 32-bit word in host order)."""
    raw = address[0].packed
    words = struct.unpack(f"={len(raw) // 4}I", raw)
    return "".join(f"{w:08X}" for w in words) + f":{address[1]:04X}"
