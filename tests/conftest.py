"""Test-wide settings.

One intra-op thread for torch: on a 2-core machine shared with other work, torch's default of one thread per
core oversubscribes and can run 10x slower; the tests measure behaviour, not speed.
"""

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

# The repository root: test modules import it (`from conftest import REPO`) rather than each working it out.
REPO = Path(__file__).resolve().parents[1]
