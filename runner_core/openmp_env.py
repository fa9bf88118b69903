"""OpenMP's wait policy for this process, set before torch loads (libgomp reads it once, at that moment).

Threads waiting at a barrier sleep (OMP_WAIT_POLICY=PASSIVE) instead of spinning (libgomp's default:
up to 300,000 iterations, milliseconds, after every parallel op): on a machine that is not idle a
spinning thread holds the core that the step's other thread, or another program, needs. Set only when
the user set neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT and torch is not loaded yet (after that it has
no effect; engine/threads.py reports the policy in effect).
"""

import os
import sys

TORCH_LOADED_FIRST = "torch" in sys.modules
if not TORCH_LOADED_FIRST and "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
