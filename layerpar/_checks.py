"""Argument checks shared by every part of layerpar (one home for them).

Each check returns the value in its plain Python type, or raises naming the argument
in backticks: `TypeError` when the value has the wrong type (``True`` is not an int
here), `ValueError` when it has the right type but is out of range or not finite.
They import nothing but the standard library, so any part (the serial `ode`
included) may use them.
"""
from __future__ import annotations

import math
import numbers
import os
from typing import Any, Optional

__all__ = ["boolean", "finite_in", "fits_in_memory", "integer", "nonneg_int",
           "positive_float", "positive_int"]


def integer(name: str, value: Any, lo: Optional[int] = None, hi: Optional[int] = None,
            *, why: str = "") -> int:
    """`value` as an int in [lo, hi] (either bound may be None: open).

    why: appended to a range error, e.g. " (the engine holds it in a C int)".
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__} {value!r}")
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        if hi is None:
            want = f">= {lo}"
        elif lo is None:
            want = f"<= {hi}"
        else:
            want = f"in [{lo}, {hi}]"
        raise ValueError(f"`{name}` must be {want}{why}, got {v}")
    return v


def positive_int(name: str, value: Any) -> int:
    """`value` as an int >= 1 ("`name` must be a positive int, got ...")."""
    return _count(name, value, 1, "a positive int")


def nonneg_int(name: str, value: Any) -> int:
    """`value` as an int >= 0 ("`name` must be an int >= 0, got ...")."""
    return _count(name, value, 0, "an int >= 0")


def _count(name: str, value: Any, lo: int, want: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be {want}, got {type(value).__name__} {value!r}")
    if value < lo:
        raise ValueError(f"`{name}` must be {want}, got {value}")
    return int(value)


def finite_in(name: str, value: Any, lo: float = -math.inf, hi: float = math.inf, *,
              lo_open: bool = False, hi_open: bool = False) -> float:
    """`value` (an int or a float, not a bool) as a finite float in the interval from
    `lo` to `hi`, each end closed unless `lo_open` / `hi_open`; an infinite end is
    always open."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a number, got {type(value).__name__} {value!r}")
    v = float(value)
    lo_open = lo_open or lo == -math.inf
    hi_open = hi_open or hi == math.inf
    ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and \
        (v < hi if hi_open else v <= hi)
    if not ok:
        if hi == math.inf and lo != -math.inf:
            want = f"{'>' if lo_open else '>='} {lo:g}"
        elif lo == -math.inf and hi != math.inf:
            want = f"{'<' if hi_open else '<='} {hi:g}"
        elif lo == -math.inf:
            want = ""
        else:
            want = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise ValueError(f"`{name}` must be a finite number{' ' + want if want else ''}, "
                         f"got {value!r}")
    return v


def positive_float(name: str, value: Any) -> float:
    """`value` as a finite float > 0."""
    return finite_in(name, value, 0.0, lo_open=True)


def boolean(name: str, value: Any) -> bool:
    """`value` if it is a bool (0 and 1 are not)."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {type(value).__name__} {value!r}")
    return value


def fits_in_memory(need: int, what: str, parts: str) -> None:
    """Raise ValueError when `need` bytes exceed this machine's physical memory: "`what`
    needs about N GiB (`parts`), more than this machine's M GiB".  A size a command line
    cannot run is refused in one line, not minutes later in an allocator's traceback
    (nothing is checked where the platform does not say its memory)."""
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if need > have:
        raise ValueError(f"{what} needs about {need / 2**30:.1f} GiB ({parts}), more than "
                         f"this machine's {have / 2**30:.1f} GiB")
