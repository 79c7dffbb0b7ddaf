"""One hash seed for every process of the suite, so a cell's memory does not depend on it.

Python randomises `hash(str)` per process, and with it the order in which a set of strings is iterated.
Model code does iterate such sets: transformers' Gemma 3 builds its two RoPE tables in the order of
`set(config.layer_types)`, so the tables are allocated in either order, the caching allocator places the
step's blocks differently, and a prediction (or a GPU measurement) of the same cell moves by up to
0.004 GiB from one process to the next. Pinning the seed makes both the same every time.

`python -m bench` calls `pin()` before anything else: a process started without the seed re-executes
itself once with it, and every process it starts (a cell's worker, torchrun's ranks, the predictor's
pool) inherits it. The runner also sets it in each worker's environment, for callers that import it.
"""

from __future__ import annotations

import os
import sys

HASH_SEED = "0"
ENV = "PYTHONHASHSEED"


def pin() -> None:
    """Re-execute this process (same interpreter, same command line) with the suite's hash seed, unless it
    already runs with it. Nothing else has run yet, so nothing is lost."""
    if os.environ.get(ENV) == HASH_SEED:
        return
    os.environ[ENV] = HASH_SEED
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
