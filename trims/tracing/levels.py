"""Trace levels: how deep a trace looks, and the order in which levels nest.

``model`` is one span per predict (pre- and post-processing as their own spans), ``layer`` the
framework's operators, ``library`` library primitives (oneDNN/MKL on the CPU where the
framework exposes them, cuDNN/cuBLAS on a GPU), ``kernel`` GPU kernels with their launches.
``full`` is every level the stack can provide. A level includes the ones above it: a
``layer`` trace has model and layer spans. ``service`` is not a level one asks for: it marks
the runtime's own spans (gateway request, queue, instance start, worker invoke), present in
every trace of an invocation.
"""

from __future__ import annotations

from enum import IntEnum

from trims.errors import ValidationError

__all__ = ["Level", "levels_up_to", "parse_level"]


class Level(IntEnum):
    SERVICE = -1
    NONE = 0
    MODEL = 1
    LAYER = 2
    LIBRARY = 3
    KERNEL = 4
    FULL = 5

    @property
    def label(self) -> str:
        return self.name.lower()


#: Level names as users write them, in nesting order (``service`` is not one: see above).
NAMES = tuple(level.label for level in Level if level is not Level.SERVICE)


def parse_level(value: object, field: str = "level") -> Level:
    """A level from its name (case-insensitive) or number; ValidationError listing the names."""
    if isinstance(value, Level):
        return value
    if isinstance(value, str) and value.strip().lower() in NAMES:
        return Level[value.strip().upper()]
    raise ValidationError(
        f"{field}: unknown trace level {value!r}; use one of {', '.join(NAMES)}", field=field
    )


def levels_up_to(level: Level) -> tuple[Level, ...]:
    """The measured levels a leveled run of depth ``level`` goes through: model .. level.

    ``full`` expands to model, layer, library and kernel; ``none`` to nothing.
    """
    deepest = Level.KERNEL if level is Level.FULL else level
    return tuple(lv for lv in Level if Level.MODEL <= lv <= deepest)
