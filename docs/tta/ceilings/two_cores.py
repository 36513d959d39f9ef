"""Whether the 2-core machine's two cores slow each other: one thread of the pass's kind
of operation (``tanh(bmm)`` on [64, 128, 32] x [64, 32, 32], 3,000 times) alone, then two
such processes side by side.

    python docs/tta/ceilings/two_cores.py alone
    python docs/tta/ceilings/two_cores.py A & python docs/tta/ceilings/two_cores.py B; wait
"""
import sys
import time

import torch

torch.set_num_threads(1)
a, b = torch.randn(64, 128, 32), torch.randn(64, 32, 32)


def run(n: int = 3000) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        torch.tanh(torch.bmm(a, b))
    return time.perf_counter() - t0


run(200)
print(sys.argv[1], round(run(), 3), flush=True)
