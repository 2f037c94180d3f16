"""An engine on a second CUDA device decodes as one on the first: a suite
of its own, on a two-GPU runner (the one-GPU runner would always skip it)."""

import unittest

import torch

from sglang import Engine
from sglang.test.ci.ci_register import register_cuda_ci
from sglang.test.test_utils import CustomTestCase

register_cuda_ci(est_time=30, stage="base-b", runner_config="2-gpu")

PROMPTS = [[7, 3, 9, 1], [4, 4, 8], [12, 50, 2, 77, 5]]


@unittest.skipUnless(torch.cuda.device_count() >= 2, "needs two CUDA devices")
class TestSecondDevice(CustomTestCase):
    def test_an_engine_on_cuda_1_decodes_as_one_on_cuda_0(self):
        # Streams, capture and synchronize act on the current device: an
        # engine on another one must make it current, or its graphs capture
        # nothing and its output read races the copy.
        outs = {}
        for device in ("cuda:0", "cuda:1", "cuda:0"):  # 0 again after 1
            engine = Engine(
                speculative_algorithm="DSPARK",
                device=device,
                random_seed=0,
                max_running_requests=8,
                cuda_graph_bs=[1, 2, 4],
            )
            before = engine.worker.graph_runner.replays
            out = engine.generate(
                input_ids=PROMPTS[:3], sampling_params={"max_new_tokens": 12}
            )
            self.assertGreater(engine.worker.graph_runner.replays, before)
            outs.setdefault(device, []).append([o["output_ids"] for o in out])
        self.assertEqual(outs["cuda:1"][0], outs["cuda:0"][0])
        self.assertEqual(outs["cuda:0"][1], outs["cuda:0"][0])


if __name__ == "__main__":
    unittest.main()
