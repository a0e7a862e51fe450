"""How often one peer may try a token on the login form: a token bucket per peer.

Note [login attempts]
~~~~~~~~~~~~~~~~~~~~~
Each peer (the connection's local user for a caller on this host, from the kernel, else its
remote address; never a header the client writes: :func:`trims.peer_cred.peer_of`) holds
``attempts`` tries, and gets one back every ``refill_s`` seconds. A login takes a try before
it asks the gateway whether the token is known, so concurrent guesses cannot all slip in
before the first one fails; a login that succeeds, or that fails for a reason other than the
token (the gateway API unreachable), gives it back. A peer with no try left is answered 429
with ``Retry-After`` and its token is not even looked at. Other peers keep their own tries,
so one peer's guessing never delays another's login. The table holds at most ``max_peers``
peers, the least recently seen first out: a peer pushed out starts again with full tries,
which costs a flood of that many addresses more than it gains.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass

from trims.errors import QueueFull

__all__ = ["LoginLimiter"]


@dataclass
class _Bucket:
    tries: float
    updated: float


class LoginLimiter:
    """Login tries per peer (Note [login attempts])."""

    def __init__(self, *, attempts: int, refill_s: float, max_peers: int = 10_000) -> None:
        self._attempts = attempts
        self._refill_s = refill_s
        self._max_peers = max_peers
        self._peers: OrderedDict[str, _Bucket] = OrderedDict()

    def _bucket(self, peer: str) -> _Bucket:
        now = time.monotonic()
        bucket = self._peers.get(peer)
        if bucket is None:
            bucket = self._peers[peer] = _Bucket(float(self._attempts), now)
            while len(self._peers) > self._max_peers:
                self._peers.popitem(last=False)
        else:
            refilled = (now - bucket.updated) / self._refill_s
            bucket.tries = min(float(self._attempts), bucket.tries + refilled)
            bucket.updated = now
            self._peers.move_to_end(peer)
        return bucket

    def take(self, peer: str) -> None:
        """Spend one of ``peer``'s tries; QueueFull (429, ``retry_after_s``) when none is left."""
        bucket = self._bucket(peer)
        if bucket.tries < 1.0:
            wait_s = max(1, math.ceil((1.0 - bucket.tries) * self._refill_s))
            raise QueueFull(
                f"too many failed logins from {peer or 'this address'}; try again in {wait_s} s",
                retry_after_s=wait_s,
            )
        bucket.tries -= 1.0

    def give_back(self, peer: str) -> None:
        """Return the try a login took that did not guess wrong."""
        bucket = self._bucket(peer)
        bucket.tries = min(float(self._attempts), bucket.tries + 1.0)
