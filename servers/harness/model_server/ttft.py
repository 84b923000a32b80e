"""Time-to-first-token distributions.

Spelled as on the command line (`--ttft SPEC`):

* `fixed:MS` (or just `MS`): always MS milliseconds;
* `uniform:LOW,HIGH`: uniformly between LOW and HIGH milliseconds;
* `lognormal:MEDIAN,SIGMA`: log-normal around MEDIAN milliseconds with shape SIGMA (the
  long right tail real model latencies show), e.g. `lognormal:50,0.5`.

The delay is applied before the first byte of a reply (the JSON body, or the first SSE event).
A turn's own `ttft_ms` replaces a draw from the distribution.
"""

from __future__ import annotations

import math
import random
import threading
from dataclasses import dataclass


@dataclass
class Ttft:
    kind: str = "fixed"
    a: float = 0.0
    b: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()

    @classmethod
    def parse(cls, spec: str, *, seed: int | None = None) -> Ttft:
        """Parse `fixed:MS`, `MS`, `uniform:LOW,HIGH` or `lognormal:MEDIAN,SIGMA`."""
        kind, _, args = spec.strip().partition(":")
        if not args:
            kind, args = "fixed", kind
        try:
            values = [float(v) for v in args.split(",")]
        except ValueError:
            raise ValueError(
                f"--ttft {spec!r}: numbers expected, e.g. fixed:50 or lognormal:50,0.5"
            ) from None
        arity = {"fixed": 1, "uniform": 2, "lognormal": 2}
        if kind not in arity or len(values) != arity[kind]:
            raise ValueError(
                f"--ttft {spec!r}: expected fixed:MS, uniform:LOW,HIGH or lognormal:MEDIAN,SIGMA"
            )
        if any(v < 0 for v in values) or (kind == "uniform" and values[0] > values[1]):
            raise ValueError(f"--ttft {spec!r}: values must be non-negative (and LOW <= HIGH)")
        return cls(kind, values[0], values[1] if len(values) > 1 else 0.0, seed)

    def sample_ms(self) -> float:
        """One draw, in milliseconds."""
        with self._lock:
            if self.kind == "uniform":
                return self._rng.uniform(self.a, self.b)
            if self.kind == "lognormal":
                if self.a == 0:
                    return 0.0
                return self._rng.lognormvariate(math.log(self.a), self.b)
            return self.a

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.a:g}"
        return f"{self.kind}:{self.a:g},{self.b:g}"
