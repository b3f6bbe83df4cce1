"""The valid range of a numeric config option (``core.config.option``'s ``min``/``max``/``above``/``below``):
each bound closed or open or absent, written as ``>= 1``, ``> 0`` or ``in [0, 1)`` in ``--help`` and
docs/configuration.md.
Every range is finite: ``not_finite`` finds the inf or NaN that no key takes (in a number, a list or a dict)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

__all__ = ["Bounds", "not_finite"]


def _first_nonfinite(value) -> float | None:
    """The first float in ``value`` (a number, or the items and dict values inside it) that is inf or NaN."""
    if isinstance(value, float):
        return None if math.isfinite(value) else value
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (tuple, list)) else ()
    return next((bad for bad in map(_first_nonfinite, items) if bad is not None), None)


def not_finite(key: str, text: str, value) -> str | None:
    """What is wrong with ``key``'s ``value`` (typed as ``text``) when it holds inf or NaN, else None:
    ``lr=inf is not finite``, ``lr=1e309 overflows to inf``, ``inf in betas=0.9,inf is not finite``."""
    bad = _first_nonfinite(value)
    if bad is None:
        return None
    if isinstance(value, (tuple, list, Mapping)):
        return f"{bad} in {key}={text} is not finite"
    if text.lstrip("+-").lower() in ("inf", "infinity", "nan"):
        return f"{key}={text} is not finite"
    return f"{key}={text} overflows to {bad}"


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The valid range of a numeric option: a lower and an upper bound, each closed or open, or absent."""
    low: float | None = None
    low_open: bool = False
    high: float | None = None
    high_open: bool = False

    @classmethod
    def of(cls, *, min=None, max=None, above=None, below=None) -> "Bounds | None":
        """The range ``option`` declares, or None for no bounds."""
        if min is not None and above is not None or max is not None and below is not None:
            raise ValueError("give min or above (and max or below), not both")
        low, high = (min if above is None else above), (max if below is None else below)
        if low is None and high is None:
            return None
        if low is not None and high is not None and low > high:
            raise ValueError(f"empty range: lower bound {low} > upper bound {high}")
        return cls(low, above is not None, high, below is not None)

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            return (f"in {'(' if self.low_open else '['}{self.low}, "
                    f"{self.high}{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        return f"{'<' if self.high_open else '<='} {self.high}"

    def keywords(self) -> dict[str, float]:
        """The ``option`` keywords that declare this range (``{"min": 0, "below": 1}``)."""
        out = {}
        if self.low is not None:
            out["above" if self.low_open else "min"] = self.low
        if self.high is not None:
            out["below" if self.high_open else "max"] = self.high
        return out

    def violation(self, value) -> Any:
        """The first number in ``value`` (a number, or the items of a tuple or list) outside the range, or None."""
        items = value if isinstance(value, (tuple, list)) else (value,)
        for x in items:
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                continue
            low_ok = self.low is None or (x > self.low if self.low_open else x >= self.low)
            high_ok = self.high is None or (x < self.high if self.high_open else x <= self.high)
            if not (low_ok and high_ok) or x != x:          # NaN is in no range
                return x
        return None
