"""Request dispatch: check an operation's arguments, then call the store.

Every argument is type-checked here, so the store sees only well-formed values and a client
that sends a wrong type gets a ValidationError naming the field, never a traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from trims.daemon.catalog import AccessList, validate_id
from trims.daemon.store import Caller, Store, StoreReply
from trims.errors import PermissionDenied, ValidationError
from trims.layout import validate_digest, validate_model_name, validate_version
from trims.protocol import CLIENT_OPS, Op, Progress

_TIERS = ("cpu", "gpu", "disk")
_MAX_SOURCE = 4096
_MAX_DEVICE = 128
#: Most uids (and, separately, gids) one access list may name.
_MAX_ACCESS_IDS = 1024


def _opt_str(args: Mapping[str, Any], key: str, limit: int = 1024) -> str | None:
    value = args.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        raise ValidationError(f"argument {key!r} must be a string of 1-{limit} characters")
    return value


def _name(args: Mapping[str, Any]) -> str:
    if "name" not in args:
        raise ValidationError("argument 'name' is required")
    return validate_model_name(args["name"])


def _version(args: Mapping[str, Any]) -> str | None:
    v = args.get("version")
    return None if v is None else validate_version(v)


def _tier(args: Mapping[str, Any], default: str | None) -> str | None:
    tier = args.get("tier", default)
    if tier is None:
        return None
    if tier not in _TIERS:
        raise ValidationError(f"argument 'tier' must be one of {list(_TIERS)}, not {tier!r}")
    return str(tier)


def _required_tier(args: Mapping[str, Any], default: str) -> str:
    tier = _tier(args, default)
    assert tier is not None
    return tier


def _access(args: Mapping[str, Any]) -> AccessList:
    raw = args.get("access")
    if raw is None:
        return AccessList()
    if not isinstance(raw, Mapping) or set(raw) - {"uids", "gids"}:
        raise ValidationError("argument 'access' must be an object {uids: [int], gids: [int]}")
    ids: dict[str, list[int]] = {}
    for key in ("uids", "gids"):
        values = raw.get(key) or []
        if not isinstance(values, list) or len(values) > _MAX_ACCESS_IDS:
            raise ValidationError(
                f"access.{key} must be a list of at most {_MAX_ACCESS_IDS} integer ids"
            )
        ids[key] = [validate_id(f"access.{key}[{i}]", v) for i, v in enumerate(values)]
    return AccessList.of(ids["uids"], ids["gids"])


def _bool(args: Mapping[str, Any], key: str) -> bool:
    value = args.get(key, False)
    if not isinstance(value, bool):
        raise ValidationError(f"argument {key!r} must be true or false")
    return value


async def dispatch(
    store: Store,
    caller: Caller,
    op_name: object,
    args: object,
    progress: Progress | None,
    admin_socket: str,
) -> StoreReply:
    """Run one request; raises TrimsError subclasses for the server to turn into replies."""
    if not isinstance(op_name, str) or op_name not in Op.__members__.values():
        raise ValidationError(
            f"unknown operation {op_name!r}; known: {', '.join(o.value for o in Op)}"
        )
    op = Op(op_name)
    if not isinstance(args, Mapping):
        raise ValidationError(f"'args' of {op.value} must be a JSON object")
    if op not in CLIENT_OPS and not caller.admin:
        raise PermissionDenied(
            f"operation {op.value} administers the store; use the admin socket {admin_socket} "
            "as the store's owner"
        )
    handler = _HANDLERS[op]
    reply: StoreReply = await handler(store, caller, args, progress)
    return reply


async def _hello(store: Store, c: Caller, a: Mapping[str, Any], p: Progress | None) -> StoreReply:
    _opt_str(a, "client", 256)
    return store.hello(c)


async def _acquire(store: Store, c: Caller, a: Mapping[str, Any], p: Progress | None) -> StoreReply:
    digest = a.get("digest")
    return await store.acquire(
        c,
        _name(a),
        _version(a),
        None if digest is None else validate_digest(digest),
        _required_tier(a, "cpu"),
        _device(a),
        strict=_bool(a, "strict"),
    )


def _device(a: Mapping[str, Any]) -> str | None:
    device = a.get("device")
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return str(device)
    return _opt_str(a, "device", _MAX_DEVICE)


async def _release(store: Store, c: Caller, a: Mapping[str, Any], p: Progress | None) -> StoreReply:
    lease = _opt_str(a, "lease", 64)
    if lease is None:
        raise ValidationError("argument 'lease' is required")
    return store.release(c, lease)


async def _info(store: Store, c: Caller, a: Mapping[str, Any], p: Progress | None) -> StoreReply:
    return store.info(c, _name(a), _version(a))


async def _list(store: Store, c: Caller, a: Mapping[str, Any], p: Progress | None) -> StoreReply:
    return store.list(c)


async def _stats(store: Store, c: Caller, a: Mapping[str, Any], p: Progress | None) -> StoreReply:
    return store.stats(c)


async def _load(store: Store, c: Caller, a: Mapping[str, Any], p: Progress | None) -> StoreReply:
    return await store.load(c, _name(a), _version(a), _required_tier(a, "cpu"), p)


async def _evict(store: Store, c: Caller, a: Mapping[str, Any], p: Progress | None) -> StoreReply:
    return await store.evict(c, _name(a), _version(a), _tier(a, None))


async def _pin(store: Store, c: Caller, a: Mapping[str, Any], p: Progress | None) -> StoreReply:
    return await store.pin(c, _name(a), _version(a), _required_tier(a, "cpu"))


async def _unpin(store: Store, c: Caller, a: Mapping[str, Any], p: Progress | None) -> StoreReply:
    return store.unpin(c, _name(a), _version(a), _tier(a, None))


async def _add(store: Store, c: Caller, a: Mapping[str, Any], p: Progress | None) -> StoreReply:
    source = _opt_str(a, "source", _MAX_SOURCE)
    if source is None:
        raise ValidationError("argument 'source' is required (a local path or a URL)")
    sha256 = a.get("sha256")
    return await store.add(
        c,
        _name(a),
        source,
        _version(a) or "1",
        _opt_str(a, "format", 32),
        None if sha256 is None else validate_digest(sha256),
        _access(a),
        p,
    )


async def _remove(store: Store, c: Caller, a: Mapping[str, Any], p: Progress | None) -> StoreReply:
    return store.remove(c, _name(a), _version(a), _bool(a, "force"))


async def _verify(store: Store, c: Caller, a: Mapping[str, Any], p: Progress | None) -> StoreReply:
    name = None if a.get("name") is None else _name(a)
    version = _version(a)
    if version is not None and name is None:
        raise ValidationError("argument 'version' needs 'name'")
    return await store.verify(c, name, version, p)


_Handler = Callable[[Store, Caller, Mapping[str, Any], "Progress | None"], Any]
_HANDLERS: dict[Op, _Handler] = {
    Op.HELLO: _hello,
    Op.ACQUIRE: _acquire,
    Op.RELEASE: _release,
    Op.INFO: _info,
    Op.LIST: _list,
    Op.STATS: _stats,
    Op.LOAD: _load,
    Op.EVICT: _evict,
    Op.PIN: _pin,
    Op.UNPIN: _unpin,
    Op.ADD: _add,
    Op.REMOVE: _remove,
    Op.VERIFY: _verify,
}
