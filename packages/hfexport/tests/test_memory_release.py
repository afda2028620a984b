"""``hfexport.memory.release_freed_memory``: freed heap pages go back to the OS (glibc ``malloc_trim``)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from hfexport.memory import current_rss_bytes, release_freed_memory


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="malloc_trim and /proc are Linux (glibc) only"
)
def test_freed_heap_holes_are_returned_to_the_os():
    # 64 KiB blocks stay below glibc's mmap threshold (heap memory); a small block kept after each
    # one leaves holes that free() cannot give back by itself (only the heap's top is trimmed)
    blocks, pins = [], []
    for _ in range(3200):  # 200 MiB
        blocks.append(np.ones(8192, dtype=np.float64))
        pins.append(np.ones(16, dtype=np.float64))
    blocks.clear()
    before = current_rss_bytes()
    assert release_freed_memory() is True
    after = current_rss_bytes()
    assert before - after > 100 * 2**20, (before, after)
    assert len(pins) == 3200 and float(pins[-1].sum()) == 16.0  # the live data is untouched
