"""NumPy names the installed numba-cuda still refers to and the installed NumPy has removed.

numba-cuda 0.30 registers an overload of `np.row_stack` when its CUDA target loads (at a kernel's
first compile), and NumPy 2.5 removed `row_stack` (an alias of `vstack` since 1.x, deprecated in
2.0): on such a machine every kernel's first compile raised AttributeError. `restore()` puts back
each such name as the alias NumPy itself documented, only where it is missing, before any kernel
of this package compiles (the package's __init__ calls it first).
"""

from __future__ import annotations

import numpy as np

# removed name -> what NumPy made it an alias of
REMOVED = {"row_stack": "vstack"}


def restore() -> list[str]:
    """The missing names set as their aliases (idempotent); returns the names set."""
    done = []
    for old, new in REMOVED.items():
        if not hasattr(np, old) and hasattr(np, new):
            setattr(np, old, getattr(np, new))
            done.append(old)
    return done
