"""The engine test matrix for XBraid against the native engine (tests/test_xbraid.py).

`CASES` runs in-process at one rank; `MPI_CASES`, a subset that covers each option,
runs at 2, 3 and 4 ranks with N not divisible by the ranks.
"""

from __future__ import annotations

from problems import Case

_T = dict(tol=1e-12)
OPTION_SETS: list[dict] = [
    dict(max_levels=1),
    dict(max_levels=2, cfactor=2, nrelax=0, **_T),           # F-relaxation
    dict(max_levels=2, cfactor=8, **_T),                     # FCF, cfactor 8
    dict(max_levels=3, cfactor=[4, 2], nrelax=[0, 1], **_T),
    dict(max_levels=4, cfactor=2, **_T),
    dict(max_levels=4, cfactor=3, fmg=True, **_T),           # F-cycles
    dict(max_levels=3, cfactor=2, skip=False, cweight=0.7, **_T),
    dict(max_levels=3, cfactor=5, nrelax=2, final_fc_relax=True, **_T),
    dict(max_levels=4, cfactor=2, tol=0.0, max_iter=3),      # fixed iteration count
    dict(max_levels=3, cfactor=2, tol=0.0, rtol=1e-6),       # relative tolerance
    dict(max_levels=4, cfactor=2, min_coarse=4, **_T),
]

CASES: list[Case] = [Case(p, n, o) for p in ("heat", "tanh") for n in (37, 64)
                     for o in OPTION_SETS]

MPI_CASES: list[Case] = [
    Case("heat", 37, OPTION_SETS[1]),
    Case("tanh", 37, OPTION_SETS[3]),
    Case("heat", 37, OPTION_SETS[5]),
    Case("tanh", 37, OPTION_SETS[6]),
    Case("heat", 37, OPTION_SETS[8]),
    Case("tanh", 37, OPTION_SETS[9]),
    Case("heat", 37, OPTION_SETS[0]),
]
