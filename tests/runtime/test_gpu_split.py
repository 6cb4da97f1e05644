"""How a node's GPUs are split between the classes of workers (one class per rank count the served models
use, `--tensor-parallel NAME=N`): one group of each first, then each class grows by whole groups up to an
equal share; GPUs that cannot hold one group of each are refused with the figures. Nothing starts Ray."""

from __future__ import annotations

import pytest

from bulkgen.runtime import WorkersDoNotFit
from bulkgen.runtime.pool import split_gpus


@pytest.mark.parametrize(
    "gpus, counts, workers",
    [
        (8, [1], {1: 8}),
        (8, [2], {2: 4}),
        (8, [1, 2], {1: 4, 2: 2}),  # each class half of the GPUs, in whole groups
        (8, [1, 4], {1: 4, 4: 1}),
        (5, [1, 4], {1: 1, 4: 1}),  # a group wider than the share still gets its one group
        (3, [1, 2], {1: 1, 2: 1}),
        (16, [1, 2, 8], {1: 5, 2: 1, 8: 1}),  # never more GPUs than there are
    ],
)
def test_each_class_gets_one_group_then_its_share(gpus, counts, workers):
    split = split_gpus(gpus, counts)
    assert split == workers
    assert sum(ranks * n for ranks, n in split.items()) <= gpus


def test_gpus_that_cannot_hold_one_group_of_each_are_refused_with_the_figures():
    with pytest.raises(WorkersDoNotFit) as err:
        split_gpus(4, [1, 8])
    assert str(err.value) == (
        "--tensor-parallel: 4 GPU(s) cannot hold one group of 1 + one group of 8 (9 GPUs); "
        "lower a model's rank count or add GPUs"
    )
