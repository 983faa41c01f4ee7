"""A value built on first use, exactly once however many threads ask at the same moment (the compiled numba
kernels: building one takes seconds, so two racing requests must not both build it)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def once(build: Callable[[], T]) -> Callable[[], T]:
    """``build`` wrapped so that its first call builds the value (under a lock, checked again inside it) and every
    later call returns that same value."""
    lock = threading.Lock()
    box: list[T] = []

    @functools.wraps(build)
    def get() -> T:
        if not box:
            with lock:
                if not box:
                    box.append(build())
        return box[0]

    return get
