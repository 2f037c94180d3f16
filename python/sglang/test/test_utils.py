"""Shared test helpers, shaped like upstream's ``sglang.test.test_utils``."""

import unittest

import torch

from sglang.srt.distributed.parallel_state import ParallelState, set_parallel


class CustomTestCase(unittest.TestCase):
    """Base test case: every test starts on a single process with a fixed seed.

    Tests that change the process-wide parallel state get it reset here, so one
    test's EP size never leaks into the next.
    """

    def setUp(self) -> None:
        super().setUp()
        torch.manual_seed(0)
        set_parallel(ParallelState())
        self.addCleanup(set_parallel, ParallelState())


def cuda_available() -> bool:
    return torch.cuda.is_available()
