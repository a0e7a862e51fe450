"""Which local user is on the other end of a request's connection.

Shared memory lets a caller make the gateway open an object on this host with the gateway's
rights; the gateway must therefore know which user asks (Note [region owners] in
:mod:`trims.runtime.gateway.oip_shm`). Over a Unix socket the kernel says (``SO_PEERCRED``).
Over TCP on loopback the kernel's socket table says: ``/proc/net/tcp`` and ``tcp6`` list each
socket with its local and remote address and the uid that owns it, so the caller's socket is
the row whose local address is the request's peer address and whose remote address is ours
(what identd does). Anything else has no local user: None.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from typing import Any

__all__ = ["peer_uid"]

_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_UCRED = struct.Struct("3i")  # pid, uid, gid

Address = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


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


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    address = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _tcp_owner(peer: Address, local: Address) -> int | None:
    """The uid owning the TCP socket whose local address is ``peer`` and remote ``local``."""
    for table in _TABLES:
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) < 8:
                continue
            if _decode(fields[1]) == peer and _decode(fields[2]) == local:
                return int(fields[7])
    return None


def _decode(text: str) -> Address | None:
    """``0100007F:1F90`` (the kernel's hex, each 32-bit word in host order) -> (ip, port)."""
    host, _, port = text.partition(":")
    try:
        raw = bytes.fromhex(host)
        words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]
        address = ipaddress.ip_address(b"".join(words))
        return _ip(str(address)), int(port, 16)
    except ValueError:
        return None
