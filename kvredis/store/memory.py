"""Memory that large reads are received into.

Outputs of :data:`HUGE_OUTPUT_RANGE` are anonymous memory advised to use transparent huge pages (Linux):
filling fresh memory is mostly page faults, and 2 MiB pages take 512 times fewer. Measured on the test VM
(docs/benchmarks-history.md): 128 MiB entries read in 52-80 ms instead of 95-110; at 16 MiB no gain (the
allocator reuses freed memory); from 256 MiB the results went both ways and 1 GiB reads got slower (a median
of 1.6 s instead of 0.76 s: fresh huge pages there cost more than they save), so those keep plain pages. The
lookup buffer's entries and the chunk store's reads use it.
"""

from __future__ import annotations

import contextlib
import mmap

import torch

HUGE_OUTPUT_RANGE = (32 << 20, 128 << 20)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def fresh_output(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes`` for a read to be received into (never zero-filled)."""
    if HUGE_OUTPUT_RANGE[0] <= nbytes <= HUGE_OUTPUT_RANGE[1] and _MADV_HUGEPAGE is not None:
        try:
            region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError:
            pass  # no such mapping here: the allocator's memory will do
        else:
            with contextlib.suppress(OSError):  # transparent huge pages off: plain pages, still correct
                region.madvise(_MADV_HUGEPAGE)
            return torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps the mapping alive
    return torch.empty(nbytes, dtype=torch.uint8)
