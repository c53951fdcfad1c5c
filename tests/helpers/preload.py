"""What the Trainer tests ask ``run_distributed``'s process pool to import once, before it forks its workers."""

import os

from hybridsp.testing import PRELOAD_ENV


def preload(*modules: str) -> None:
    """Add ``modules`` to :data:`hybridsp.testing.PRELOAD_ENV`, keeping what is there already (in order, once)."""
    current = os.environ.get(PRELOAD_ENV, "").split(",")
    os.environ[PRELOAD_ENV] = ",".join(name for name in dict.fromkeys(current + list(modules)) if name)
