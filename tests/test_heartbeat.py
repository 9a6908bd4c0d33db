"""heartbeat.beating: the count moves while a block with nothing to count runs, and stops when it ends."""
import time

from fleetrl import heartbeat


def test_beating_moves_the_count_only_while_the_block_runs():
    before = heartbeat.count()
    with heartbeat.beating(every_s=0.05):
        time.sleep(0.5)  # ~10 beats; a loaded CI box may deliver fewer, never none
        during = heartbeat.count()
    assert during - before >= 3
    after = heartbeat.count()
    time.sleep(0.2)
    assert heartbeat.count() == after  # the thread is gone: an idle worker's count stands still


def test_beating_stops_when_the_block_raises():
    try:
        with heartbeat.beating(every_s=0.05):
            raise KeyError("x")
    except KeyError:
        pass
    after = heartbeat.count()
    time.sleep(0.2)
    assert heartbeat.count() == after
