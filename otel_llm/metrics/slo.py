"""Service-level objectives: upper bounds a request must meet to count as good (spec: Goodput)."""

from __future__ import annotations

from dataclasses import dataclass

BOUNDS = ("ttft", "tpot", "itl_max", "e2e")


@dataclass(frozen=True)
class SLO:
    """Upper bounds in seconds (``tpot`` in seconds per token); ``None`` means no bound.

    ``tpot_undefined``: what a request with N <= 1 output tokens does against a ``tpot`` bound:
    ``"pass"`` (the spec's default: the bound is vacuous) or ``"fail"``.
    """

    ttft: float | None = None
    tpot: float | None = None
    itl_max: float | None = None
    e2e: float | None = None
    tpot_undefined: str = "pass"

    def __post_init__(self) -> None:
        if self.tpot_undefined not in ("pass", "fail"):
            raise ValueError("tpot_undefined must be 'pass' or 'fail'")
        for name in BOUNDS:
            v = getattr(self, name)
            if v is not None and not v >= 0:
                raise ValueError(f"SLO bound {name} must be a non-negative number of seconds, got {v}")

    @property
    def bounds(self) -> dict[str, float]:
        """The bounds that are set, in :data:`BOUNDS` order."""
        return {k: getattr(self, k) for k in BOUNDS if getattr(self, k) is not None}

    @classmethod
    def parse(cls, text: str, tpot_undefined: str = "pass") -> SLO:
        """Parse ``ttft=1,tpot=0.05,itl_max=0.5,e2e=10`` (seconds, any subset)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, val = part.partition("=")
            key = key.strip()
            if not sep or key not in BOUNDS:
                raise ValueError(f"bad SLO term {part!r}: expected NAME=SECONDS with NAME one of {', '.join(BOUNDS)}")
            if key in values:
                raise ValueError(f"SLO bound {key} given twice")
            try:
                values[key] = float(val)
            except ValueError:
                raise ValueError(f"bad SLO value in {part!r}: not a number of seconds") from None
        return cls(**values, tpot_undefined=tpot_undefined)

    @classmethod
    def parse_named(cls, text: str, tpot_undefined: str = "pass") -> tuple[str, SLO]:
        """Parse ``[NAME:]ttft=1,tpot=0.05``, the one grammar of every ``--slo``: the collector
        keeps several by name, the analysis commands take one (the name defaults to ``default``)."""
        name, sep, bounds = text.partition(":")
        if not sep:
            name, bounds = "default", text
        name = name.strip()
        if not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"bad SLO name {name!r}")
        return name, cls.parse(bounds, tpot_undefined)

    def describe(self) -> str:
        return ",".join(f"{k}={v:g}" for k, v in self.bounds.items()) or "none"
