"""kill -9 under load, a few cycles (``kvstore bench crash`` runs twenty): every block whose
commit returned is served after the restart, byte for byte, and a torn or unacknowledged slot
is never served. The dead server's arena is salvaged by its journal into nvme."""

from __future__ import annotations

import random

import pytest

from benchmarks.crash import kill_cycles

MiB = 1 << 20


def test_acknowledged_blocks_survive_kill_9_under_load() -> None:
    # 400 blocks of 256 KiB per cycle stay inside the arena, with the blocks read back and
    # promoted in earlier cycles: what is measured is the crash, not eviction to nvme.
    result = kill_cycles(3, 512 * MiB, max_load_s=0.8, rng=random.Random(7), max_blocks=400)
    print(result.per_cycle)
    assert result.acked >= 300, "the load barely ran: nothing was measured"
    assert result.corrupt == 0
    assert result.served >= 0.99 * result.acked
    assert result.served_at_end >= 0.99 * result.acked


@pytest.mark.slow
def test_without_the_journal_a_kill_loses_the_arena() -> None:
    """The same loop with the journal off: the check above can fail."""
    result = kill_cycles(
        1, 512 * MiB, max_load_s=0.8, rng=random.Random(7), max_blocks=400, settings={"dram.journal": "false"}
    )
    assert result.acked > 0 and result.served < 0.5 * result.acked and result.corrupt == 0
