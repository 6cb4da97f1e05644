"""The rules that keep the runtime's storage requests by the line (bulkgen.runtime.pacing), on a clock the
test holds: how many progress writes a batch makes however long it runs, and the listing back-off."""

from __future__ import annotations

from bulkgen.runtime.pacing import Backoff, ProgressPacer


def writes(pacer: ProgressPacer, settled_at: list[tuple[float, int]]) -> list[float]:
    """The times a runner looking every 0.5 s writes progress, for (time, lines settled by then) steps."""
    done = []
    for now, settled in settled_at:
        if pacer.due(settled, now):
            pacer.written(settled, now)
            done.append(now)
    return done


def test_a_batch_writes_its_progress_per_tenth_of_its_lines_however_long_it_runs():
    for seconds in (50, 5_000):  # 10,000 lines in 50 s or in 5,000 s: about ten writes either way
        looks = int(seconds / 0.5)
        steps = [(i * 0.5, 10_000 * (i + 1) // looks) for i in range(looks)]
        made = writes(ProgressPacer(10_000, quiet_s=float("inf")), steps)
        assert 10 <= len(made) <= 11, (seconds, len(made))


def test_progress_waits_for_the_floor_and_a_slow_batch_still_shows_it():
    pacer = ProgressPacer(1_000, floor_s=2.0, quiet_s=20.0)
    assert pacer.due(1, 0.0)  # the first result is shown at once
    pacer.written(1, 0.0)
    assert not pacer.due(900, 1.5)  # within the floor, whatever moved
    assert pacer.due(900, 2.0)
    pacer.written(900, 2.0)
    assert not pacer.due(901, 21.9) and pacer.due(901, 22.0)  # one line in 20 s: written after 20 s
    pacer.written(901, 22.0)
    assert not pacer.due(901, 500.0)  # nothing moved: nothing written


def test_listing_backs_off_to_the_cap_and_starts_over():
    backoff = Backoff(2.0, 60.0)
    assert [backoff.next() for _ in range(7)] == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    backoff.reset()
    assert backoff.next() == 2.0
