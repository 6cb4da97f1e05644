"""Hand-computed cases for the batching simulator (see bulkgen/lab/sim/batching.py for the conventions)."""

import pytest

from bulkgen.lab.sim import SimulationInputError, Workload, simulate

SEED_LENGTHS = (8, 4, 3, 10, 2, 5, 7, 1)


def test_static_seed_example():
    # Groups r0-r3 (longest 10) then r4-r7 (longest 7): 10 + 7 steps, 4 slots held throughout.
    m = simulate(Workload(SEED_LENGTHS), "static", 4).metrics()
    assert m["makespan"] == 17
    assert m["slot_steps"] == 4 * 10 + 4 * 7 == 68
    assert m["useful_tokens"] == 40
    assert m["wasted_slot_steps"] == 28
    assert m["waste_pct"] == pytest.approx(100 * 28 / 68, abs=0.01)
    assert m["raw_occupancy"] == 1.0
    assert m["slot_efficiency"] == pytest.approx(40 / 68, abs=1e-4)
    assert m["useful_tokens_per_step"] == pytest.approx(40 / 17, abs=1e-4)
    assert m["finish_steps"] == {f"r{i}": 10 if i < 4 else 17 for i in range(8)}


def test_continuous_seed_example():
    # Steps 0-2: r0..r3. r2 (3 tokens) frees slot 2 before step 3 -> r4 (done 5); r1 frees slot 1
    # before step 4 -> r5 (done 9); r4 frees slot 2 before step 5 -> r6 (done 12); r0 frees slot 0
    # before step 8 -> r7 (done 9); r3 is done at 10.
    result = simulate(Workload(SEED_LENGTHS), "continuous", 4)
    m = result.metrics()
    assert m["finish_steps"] == {"r0": 8, "r1": 4, "r2": 3, "r3": 10, "r4": 5, "r5": 9, "r6": 12, "r7": 9}
    assert m["makespan"] == 12
    assert m["slot_steps"] == m["useful_tokens"] == 40
    assert m["wasted_slot_steps"] == 0 and m["waste_pct"] == 0.0
    assert m["raw_occupancy"] == pytest.approx(40 / 48, abs=1e-4)
    assert m["slot_efficiency"] == 1.0
    slots = {seg.request: (seg.slot, seg.start) for seg in result.segments}
    assert slots[4] == (2, 3) and slots[5] == (1, 4) and slots[6] == (2, 5) and slots[7] == (0, 8)


def test_dynamic_without_arrivals_equals_static():
    static = simulate(Workload(SEED_LENGTHS), "static", 4).metrics()
    dynamic = simulate(Workload(SEED_LENGTHS), "dynamic", 4, max_wait=3).metrics()
    assert {k: v for k, v in dynamic.items() if k != "policy"} == {
        k: v for k, v in static.items() if k != "policy"
    }


ARRIVING = Workload((3, 1, 2, 2, 1), arrivals=(0, 1, 2, 3, 10))


def test_static_waits_for_last_member_of_group():
    # [r0,r1,r2] starts when r2 arrives (2), runs 3 -> 5; [r3,r4] starts when r4 arrives (10), runs 2 -> 12.
    m = simulate(ARRIVING, "static", 3).metrics()
    assert m["finish_steps"] == {"r0": 5, "r1": 5, "r2": 5, "r3": 12, "r4": 12}
    assert m["slot_steps"] == 3 * 3 + 2 * 2
    assert m["makespan"] == 12


def test_dynamic_launches_on_max_wait():
    # t=0 only r0 waits; r1 arrives at 1, when r0 has waited max_wait=1 -> [r0,r1] runs 1..4.
    # At 4, r2 and r3 wait and r2 has waited 2 >= 1 -> [r2,r3] runs 4..6. r4 arrives at 10,
    # waits 1 step alone (the batcher cannot know nothing else comes) -> runs 11..12.
    m = simulate(ARRIVING, "dynamic", 3, max_wait=1).metrics()
    assert m["finish_steps"] == {"r0": 4, "r1": 4, "r2": 6, "r3": 6, "r4": 12}
    assert m["slot_steps"] == 2 * 3 + 2 * 2 + 1 * 1
    assert m["wasted_slot_steps"] == 2


def test_dynamic_with_zero_wait_launches_whatever_is_waiting():
    # [r0] 0..3; at 3 r1,r2,r3 wait (a full batch) -> 3..5; r4 at 10 -> 10..11.
    m = simulate(ARRIVING, "dynamic", 3, max_wait=0).metrics()
    assert m["finish_steps"] == {"r0": 3, "r1": 5, "r2": 5, "r3": 5, "r4": 11}
    assert m["slot_steps"] == 3 + 3 * 2 + 1


def test_continuous_never_admits_before_arrival():
    result = simulate(ARRIVING, "continuous", 3)
    m = result.metrics()
    assert m["finish_steps"] == {"r0": 3, "r1": 2, "r2": 4, "r3": 5, "r4": 11}
    assert m["makespan"] == 11 and m["slot_steps"] == 9
    for seg in result.segments:
        assert seg.start >= ARRIVING.arrivals[seg.request]


def test_prefill_padding_per_group():
    work = Workload(SEED_LENGTHS, prompt_lengths=(12, 200, 30, 45, 5, 6, 7, 8))
    static = simulate(work, "static", 4).metrics()
    assert static["prefill_slots"] == 4 * 200 + 4 * 8
    assert static["prefill_useful"] == 313
    assert static["prefill_waste_pct"] == pytest.approx(100 * (832 - 313) / 832, abs=0.01)
    continuous = simulate(work, "continuous", 4).metrics()
    assert continuous["prefill_slots"] == continuous["prefill_useful"] == 313
    assert continuous["prefill_waste_pct"] == 0.0
    assert "prefill_slots" not in simulate(Workload(SEED_LENGTHS), "static", 4).metrics()


def test_slots_never_exceed_max_batch_and_never_overlap():
    work = Workload((5, 1, 9, 2, 2, 7, 3, 3, 1, 4), arrivals=(0, 0, 1, 1, 2, 4, 4, 9, 9, 20))
    for policy in ("static", "dynamic", "continuous"):
        result = simulate(work, policy, 3, max_wait=2)
        for step in range(result.makespan):
            busy = [seg.slot for seg in result.segments if seg.start <= step < seg.release]
            assert len(busy) == len(set(busy)) <= 3, (policy, step)


def test_single_request_and_batch_larger_than_requests():
    m = simulate(Workload((5,)), "static", 4).metrics()
    assert m["makespan"] == 5 and m["slot_steps"] == 5
    assert m["raw_occupancy"] == pytest.approx(5 / 20)


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        ({"lengths": ()}, "lengths", "at least one"),
        ({"lengths": (3, -1)}, "lengths", "r1 is -1"),
        ({"lengths": (3, 0)}, "lengths", "r1 is 0"),
        ({"lengths": (3, 2), "arrivals": (0,)}, "arrivals", "got 1 values for 2"),
        ({"lengths": (3, 2), "arrivals": (4, 1)}, "arrivals", "non-decreasing"),
        ({"lengths": (3, 2), "arrivals": (0, -1)}, "arrivals", "r1 is -1"),
        ({"lengths": (3, 2), "prompt_lengths": (4, 5, 6)}, "prompt_lengths", "got 3 values"),
    ],
)
def test_bad_workload_names_the_field(kwargs, field, words):
    with pytest.raises(SimulationInputError, match=words) as info:
        Workload(**kwargs)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("policy", "max_batch", "max_wait", "field"),
    [("static", 0, 1, "max_batch"), ("dynamic", 2, -1, "max_wait"), ("greedy", 2, 1, "policy")],
)
def test_bad_simulate_arguments(policy, max_batch, max_wait, field):
    with pytest.raises(SimulationInputError) as info:
        simulate(Workload((1, 2)), policy, max_batch, max_wait)
    assert info.value.field == field
