"""Fixtures shared by the training-job tests."""

import pytest

from tests.training._job import train


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory) -> dict[int, float]:
    """The losses of 6 uninterrupted iterations on 2 ranks, to compare resumed runs with."""
    return train(tmp_path_factory.mktemp("straight"), "straight", 2, "--train-iters", "6")
