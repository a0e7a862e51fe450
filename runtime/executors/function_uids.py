"""Each function's own uid in a container: how the docker and kubernetes executors pick it.

Note [one uid per function]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The store counts connections per peer uid (``max_connections_per_uid``) and a model's access
list names uids. Containers of different functions that shared one uid would share those too:
one function holding its uid's connection slots would fail another function's cold start. So
a container executor runs each function as a uid of its own, from a range
(``uid_base`` .. ``uid_base + uid_count - 1``):

* picked from the function's name (sha256, modulo the range), so a function keeps its uid
  across gateway restarts, and the operator's Deployments, which no executor tracks, get the
  same one;
* probing upwards (wrapping within the range) past a uid that another function the executor
  runs or is starting holds, and past reserved uids (root, the gateway's own, the daemon's):
  the instances of one function share its uid, two functions running at once never do;
* its group is the same number: a container reaches the store socket through a supplementary
  group (the socket's), so the primary group needs to grant nothing.

The range must hold no uid of a person or a service on the node; the default (200000 and up)
is above the ids distributions hand out and below 2^31.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Collection, Iterable, Iterator, Mapping

from trims.errors import Unavailable, ValidationError

__all__ = [
    "DEFAULT_UID_BASE",
    "DEFAULT_UID_COUNT",
    "FunctionUids",
    "check_uid_range",
    "function_uid",
]

DEFAULT_UID_BASE = 200_000
DEFAULT_UID_COUNT = 65_536
#: The largest uid: 2^32 - 1 is (uid_t)-1, "no uid" to setresuid and chown.
_MAX_UID = 2**32 - 2


def check_uid_range(base: int, count: int, what: str) -> None:
    """ValidationError unless ``base .. base + count - 1`` are uids a function may run as."""
    if base < 1:
        raise ValidationError(f"{what}: uid_base {base} must be at least 1 (root never runs code)")
    if count < 1:
        raise ValidationError(f"{what}: uid_count {count} must be at least 1")
    if base + count - 1 > _MAX_UID:
        raise ValidationError(
            f"{what}: uids {base} .. {base + count - 1} go past {_MAX_UID}, the largest uid; "
            "lower uid_base or uid_count"
        )


def function_uid(
    function: str,
    base: int,
    count: int,
    *,
    held: Mapping[int, str],
    reserved: Collection[int] = (),
) -> int:
    """The uid ``function`` runs as (Note [one uid per function]): the one it holds in ``held``
    (uid -> function), else the first from its name's slot not held and not ``reserved``."""
    for uid, holder in held.items():
        if holder == function:
            return uid
    slot = int.from_bytes(hashlib.sha256(function.encode()).digest()[:8], "big") % count
    for step in range(count):
        uid = base + (slot + step) % count
        if uid not in held and uid not in reserved:
            return uid
    raise Unavailable(
        f"function {function}: every uid from {base} to {base + count - 1} is held by another "
        "function or reserved; stop a function, or raise uid_count"
    )


class FunctionUids:
    """The uids of the functions one executor runs and starts (Note [one uid per function]).

    What the executor runs comes from its table of instances at each call, so nothing is
    released when an instance stops; what it is starting is held here from the moment the uid
    is picked until the instance is in that table, so two starts at once never pick one uid.
    """

    def __init__(self, base: int, count: int) -> None:
        self.base = base
        self.count = count
        #: instance id -> (function, uid) of the instances being started.
        self._starting: dict[str, tuple[str, int]] = {}

    def uid_for(
        self,
        function: str,
        running: Iterable[tuple[str, int]],
        reserved: Collection[int] = (),
    ) -> int:
        """The uid ``function`` has now or would get: ``running`` are the (function, uid) of
        the executor's instances."""
        held = {uid: holder for holder, uid in (*running, *self._starting.values())}
        return function_uid(function, self.base, self.count, held=held, reserved=reserved)

    @contextlib.contextmanager
    def starting(
        self,
        function: str,
        instance_id: str,
        running: Iterable[tuple[str, int]],
        reserved: Collection[int] = (),
    ) -> Iterator[int]:
        """The uid for a new instance, held while the block starts it (and tracks it)."""
        uid = self.uid_for(function, running, reserved)
        self._starting[instance_id] = (function, uid)
        try:
            yield uid
        finally:
            del self._starting[instance_id]
