"""Shared test helpers, shaped like upstream's ``sglang.test.test_utils``."""

import contextlib
import json
import os
import tempfile
import unittest
from typing import Iterator, List

import torch

from sglang.srt.runtime_context import get_parallel

# Tests run with a fixed, small intra-op thread count: on a loaded 2-core
# machine torch's default oversubscribes (the suite took 319 s instead of 30).
TEST_NUM_THREADS = 1


class CustomTestCase(unittest.TestCase):
    """Base test case: every test starts on a single process with a fixed seed.

    Tests that change the process-wide parallel state get it reset here, so one
    test's EP size never leaks into the next.
    """

    @classmethod
    def setUpClass(cls) -> None:
        torch.set_num_threads(TEST_NUM_THREADS)
        super().setUpClass()

    def setUp(self) -> None:
        super().setUp()
        torch.manual_seed(0)
        get_parallel().reset()
        self.addCleanup(get_parallel().reset)


def cuda_available() -> bool:
    return torch.cuda.is_available()


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    """The process's umask set to ``mask`` inside, restored after."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@contextlib.contextmanager
def record_decode_batch_sizes(engine) -> Iterator[List[int]]:
    """Yield a list that fills with the batch size of every decode step."""
    sizes: List[int] = []
    step = engine.worker.decode_step

    def spy(*, batch):
        sizes.append(batch.batch_size)
        return step(batch=batch)

    engine.worker.decode_step = spy
    try:
        yield sizes
    finally:
        del engine.worker.decode_step


def queue_requests(scheduler, prompts, *, max_new_tokens: int, first_rid: int):
    """``Req``s of ``prompts`` (greedy, ``max_new_tokens`` each, ids from
    ``first_rid``) added to ``scheduler``'s queue; returned in order."""
    from sglang.srt.managers.schedule_batch import Req, SamplingParams

    reqs = [
        Req(
            rid=first_rid + i,
            origin_input_ids=ids,
            sampling_params=SamplingParams(max_new_tokens),
        )
        for i, ids in enumerate(prompts)
    ]
    for r in reqs:
        scheduler.add_request(r)
    return reqs


def spawn_ranks(rank_main, *, world_size: int = 2) -> List[dict]:
    """Run ``rank_main(rank, world_size, port, out_dir)`` on ``world_size``
    local processes (a free port for their group); each writes
    ``out_dir/rank{rank}.json``. Returns those results in rank order."""
    import torch.multiprocessing as mp

    from sglang.srt.distributed.parallel_state import get_open_port

    with tempfile.TemporaryDirectory() as out_dir:
        args = (world_size, get_open_port(), out_dir)
        mp.spawn(rank_main, args=args, nprocs=world_size, join=True)
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                results.append(json.load(f))
    return results


def expert_groups(xs: torch.Tensor, offs: torch.Tensor):
    """The (local expert, its input rows) of a grouped call (masked pairs and
    other ranks' are cut off before it)."""
    ends = offs.tolist()
    return [
        (e, xs[start:end])
        for e, (start, end) in enumerate(zip([0] + ends[:-1], ends))
        if end > start
    ]


def dspark_step_views(bs: int, gamma: int, vocab: int, max_bs: int = 0):
    """DSpark step buffers of their own (no model behind them), cut to
    ``bs``: for tests of the acceptance rules on synthetic logits."""
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.speculative.dspark_components.dspark_buffers import (
        DSparkStepBuffers,
    )

    runner = ModelRunner(
        forward=None, req_to_token_pool=None, token_to_kv_pool=None, device="cpu"
    )
    buffers = DSparkStepBuffers(
        max_batch_size=max(bs, max_bs),
        gamma=gamma,
        vocab_size=vocab,
        markov_rank=1,
        mask_token_id=0,
        target_runner=runner,
        draft_runner=runner,
    )
    buffers.set_constants(bs)
    return buffers.at(bs)
