"""The one strict dataclass reader: a dict with exactly known fields -> an instance, or a clear error."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def strict_from_dict(cls: type[T], d: dict[str, Any], what: str | None = None) -> T:
    """cls(**d), refusing unknown keys with a ValueError that names them (`what` names the thing, default
    "<cls> fields"); missing required fields and the class's own validation raise as cls does."""
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown {what or cls.__name__ + ' fields'}: {sorted(unknown)}")
    return cls(**d)
