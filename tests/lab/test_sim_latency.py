import math

import pytest

from bulkgen.lab.sim import LatencyBudget


def test_budget_parts():
    budget = LatencyBudget(ttft_ms=200, tpot_ms=20, output_tokens=101)
    assert budget.decode_ms == 2000
    assert budget.end_to_end_ms == 2200
    assert budget.as_dict() == {
        "ttft_ms": 200,
        "tpot_ms": 20,
        "output_tokens": 101,
        "decode_ms": 2000,
        "end_to_end_ms": 2200,
    }
    text = budget.describe()
    assert "2200.00 ms" in text and "9.1%" in text and "90.9%" in text


def test_one_token_is_just_ttft():
    assert LatencyBudget(150.5, 30, 1).end_to_end_ms == 150.5


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ((-1, 2, 3), "ttft_ms"),
        ((1, math.nan, 3), "tpot_ms"),
        ((1, 2, 0), "output_tokens"),
        ((1, 2, 2.5), "output_tokens"),
    ],
)
def test_bad_input(args, words):
    with pytest.raises(ValueError, match=words):
        LatencyBudget(*args)
