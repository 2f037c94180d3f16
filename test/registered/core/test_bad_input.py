"""Bad input fails fast with a ValueError naming the value; a rejected
request never changes the others' outputs, and leaves the pools whole.

Token ids may be Python ints or numpy / torch integer scalars of any width;
they are converted once, before anything is allocated.
"""

import unittest

import numpy as np
import torch

from sglang import Engine
from sglang.srt.managers.schedule_batch import Req, SamplingParams
from sglang.srt.speculative.dspark_components.dspark_config import DSparkConfig
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import (
    CustomTestCase,
    queue_requests,
    record_decode_batch_sizes,
)

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

GOOD = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]]
INT_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
INT_DTYPES += [
    getattr(torch, f"uint{b}") for b in (16, 32, 64) if hasattr(torch, f"uint{b}")
]
PARAMS = {"max_new_tokens": 12}


class TestBadRequests(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.engine = Engine(
            speculative_algorithm="DSPARK",
            device="cpu",
            context_length=64,
            max_total_tokens=256,
        )
        cls.expected = [
            o["output_ids"]
            for o in Engine(speculative_algorithm="DSPARK", device="cpu").generate(
                input_ids=GOOD, sampling_params=PARAMS
            )
        ]

    def _assert_good_unchanged(self):
        outs = self.engine.generate(input_ids=GOOD, sampling_params=PARAMS)
        self.assertEqual([o["output_ids"] for o in outs], self.expected)
        self._assert_pools_whole()

    def _assert_pools_whole(self):
        sched = self.engine.scheduler
        sched.check_pool_accounting()  # free + held == total, rows and slots
        self.assertFalse(sched.has_work())
        self.assertEqual(self.engine.allocator.available(), 256)
        self.assertEqual(self.engine.req_to_token_pool.available(), 8)

    def test_each_bad_request(self):
        cases = [
            ([], PARAMS, "input_ids is empty"),
            ([1, -1], PARAMS, "token id -1"),
            ([1, 256], PARAMS, "token id 256"),
            ([1, 2.5], PARAMS, "token id 2.5"),
            ([True, 2], PARAMS, "token id True"),
            ([1] * 60, PARAMS, "= 72 exceeds context_length 64"),
            ([1] * 50, PARAMS, "= 66 exceeds the KV capacity 64"),  # the window
            ([1, 2], {"max_new_tokens": 0}, "max_new_tokens must be an int > 0, got 0"),
            ([1, 2], {"max_new_tokens": -3}, "got -3"),
            ([1, 2], {"max_new_tokens": 2.0}, "got 2.0"),
            ([1, 2], {"temperature": -0.5}, "temperature .* got -0.5"),
            ([1, 2], {"temperature": float("inf")}, "temperature .* got inf"),
            # Ints past float's range: refused, not an OverflowError.
            ([1, 2], {"temperature": 10**400}, "temperature .* got 1000"),
            ([1, 2], {"top_p": -(10**400)}, "top_p .* got -1000"),
            ([1, 2], {"frequency_penalty": 10**400}, "frequency_penalty .* got 1000"),
            ([1, 2], {"top_q": 1}, "top_q"),
            ([1, np.float32(2)], PARAMS, r"token id np.float32\(2.0\)"),
            ([1, np.bool_(True)], PARAMS, "token id np.True_"),
            ([1, np.uint64(2**64 - 1)], PARAMS, "token id np.uint64"),
            ([1, np.int8(-1)], PARAMS, r"token id np.int8\(-1\)"),
            ([1, torch.tensor(2.0)], PARAMS, r"token id tensor\(2.\)"),
            ([1, torch.tensor([2])], PARAMS, r"token id tensor\(\[2\]\)"),
            ([1, torch.tensor(True)], PARAMS, r"token id tensor\(True\)"),
            ([1, "2"], PARAMS, "token id '2'"),
            ([1, None], PARAMS, "token id None at position 1"),
            ([1, 2], {"temperature": float("nan")}, "temperature .* got nan"),
            ([1, 2], {"temperature": "0.5"}, "temperature .* got '0.5'"),
            ([1, 2], {"max_new_tokens": True}, "max_new_tokens .* got True"),
            ([1, 2], {"max_new_tokens": np.float64(3)}, "max_new_tokens"),
            ([1, 2], None, "sampling_params must be a dict, got None"),
            ([1, 2], [("max_new_tokens", 2)], "sampling_params must be a dict"),
        ]
        for ids, params, needle in cases:
            with self.subTest(ids=ids[:3], params=params):
                batch = GOOD[:1] + [ids] + GOOD[1:]
                per_req = [PARAMS, params, PARAMS, PARAMS]
                with self.assertRaisesRegex(ValueError, needle) as ctx:
                    self.engine.generate(input_ids=batch, sampling_params=per_req)
                self.assertIn("input 1", str(ctx.exception))
                self._assert_pools_whole()
        self._assert_good_unchanged()

    def test_numpy_and_torch_integer_ids_of_every_width(self):
        # Each is converted once to a Python int: the output equals the ints'.
        widths = [np.int8, np.int16, np.int32, np.int64]
        widths += [np.uint8, np.uint16, np.uint32, np.uint64]
        widths += [lambda t, d=d: torch.tensor(t, dtype=d) for d in INT_DTYPES]
        for make in widths:
            with self.subTest(make=make):
                batch = [[make(t) for t in ids] for ids in GOOD]
                outs = self.engine.generate(input_ids=batch, sampling_params=PARAMS)
                self.assertEqual([o["output_ids"] for o in outs], self.expected)
                self._assert_pools_whole()
        params = {"max_new_tokens": np.int64(12), "temperature": np.float32(0)}
        outs = self.engine.generate(input_ids=GOOD, sampling_params=params)
        self.assertEqual([o["output_ids"] for o in outs], self.expected)

    def test_kv_capacity_is_exact(self):
        # Prompt 8 + 8 new + gamma 5 touches positions 0..19 (the last output
        # token never enters the KV): exactly fits a context of 20.
        engine = Engine(speculative_algorithm="DSPARK", device="cpu", context_length=20)
        out = engine.generate(
            input_ids=[[7] * 8], sampling_params={"max_new_tokens": 8}
        )
        self.assertEqual(len(out[0]["output_ids"]), 8)
        with self.assertRaisesRegex(ValueError, "= 21 exceeds the KV capacity 20"):
            engine.generate(input_ids=[[7] * 9], sampling_params={"max_new_tokens": 8})
        # Plain decoding writes no window: prompt + max_new_tokens up to the
        # context, exactly, and not one token past it.
        plain = Engine(device="cpu", context_length=20)
        out = plain.generate(
            input_ids=[[7] * 8], sampling_params={"max_new_tokens": 12}
        )
        self.assertEqual(len(out[0]["output_ids"]), 12)
        with self.assertRaisesRegex(ValueError, "= 21 exceeds context_length 20"):
            plain.generate(input_ids=[[7] * 8], sampling_params={"max_new_tokens": 13})

    def test_running_cap_holds_with_spare_request_rows(self):
        # 8 request rows in the pool, but at most 2 may run at once.
        sched = self.engine.scheduler
        sched.max_running_requests = 2
        try:
            with record_decode_batch_sizes(self.engine) as sizes:
                outs = self.engine.generate(input_ids=GOOD, sampling_params=PARAMS)
        finally:
            sched.max_running_requests = 8
        self.assertEqual(max(sizes), 2)
        self.assertEqual([o["output_ids"] for o in outs], self.expected)

    def test_failed_prefill_returns_its_kv(self):
        engine = Engine(speculative_algorithm="DSPARK", device="cpu")
        free_slots, free_rows = (
            engine.allocator.available(),
            engine.req_to_token_pool.available(),
        )

        def broken(*, req):
            raise RuntimeError("prefill failed")

        engine.worker.prefill = broken
        req = Req(rid=1, origin_input_ids=[1, 2, 3], sampling_params=SamplingParams(4))
        engine.scheduler.add_request(req)
        with self.assertRaisesRegex(RuntimeError, "prefill failed"):
            engine.scheduler.step()
        engine.scheduler.check_pool_accounting()
        self.assertEqual(engine.allocator.available(), free_slots)
        self.assertEqual(engine.req_to_token_pool.available(), free_rows)
        self.assertIsNone(req.req_pool_idx)

    def test_malformed_call(self):
        with self.assertRaisesRegex(ValueError, "list of token-id lists"):
            self.engine.generate(input_ids=[1, 2, 3])
        with self.assertRaisesRegex(ValueError, "2 sampling_params for 3 requests"):
            self.engine.generate(input_ids=GOOD, sampling_params=[PARAMS, PARAMS])
        steps = self.engine.scheduler.num_decode_steps
        with self.assertRaisesRegex(ValueError, "progress must be callable, got 5"):
            self.engine.generate(input_ids=GOOD, sampling_params=PARAMS, progress=5)
        self.assertEqual(self.engine.scheduler.num_decode_steps, steps)  # none ran
        self._assert_pools_whole()
        for seed in (1.5, "3", None, True, -1, 2**63):
            with self.subTest(seed=seed):
                with self.assertRaisesRegex(
                    ValueError, rf"seed must be an int in \[0, 2\*\*63\), got {seed!r}"
                ):
                    self.engine.reseed(seed)

    def test_rejected_mid_flight_leaves_running_requests_alone(self):
        sched = self.engine.scheduler
        reqs = queue_requests(sched, GOOD, max_new_tokens=12, first_rid=100)
        sched.step()
        sched.step()  # running, part-way through decoding
        with self.assertRaisesRegex(ValueError, "token id 999"):
            sched.add_request(
                Req(rid=200, origin_input_ids=[999], sampling_params=SamplingParams())
            )
        while sched.has_work():
            sched.step()
        self.assertEqual([r.output_ids for r in reqs], self.expected)
        self._assert_pools_whole()


class TestBadConfig(CustomTestCase):
    def _config(self, **changes):
        base = dict(
            gamma=4,
            mask_token_id=255,
            markov_rank=16,
            target_layer_ids=(1, 2),
            vocab_size=256,
            num_target_layers=4,
        )
        base.update(changes)
        return DSparkConfig(**base)

    def test_valid(self):
        self.assertEqual(self._config().gamma, 4)

    def test_each_bad_value(self):
        cases = [
            ({"gamma": 0}, "gamma must be an int >= 1, got 0"),
            ({"gamma": 2.0}, "gamma .* got 2.0"),
            ({"mask_token_id": 256}, "mask_token_id .* got 256"),
            ({"mask_token_id": -1}, "mask_token_id .* got -1"),
            ({"markov_rank": 0}, "markov_rank .* got 0"),
            ({"target_layer_ids": ()}, r"target_layer_ids .* got \(\)"),
            ({"target_layer_ids": (2, 1)}, r"got \(2, 1\)"),
            ({"target_layer_ids": (1, 1)}, r"got \(1, 1\)"),
            ({"target_layer_ids": (1, 3)}, r"never the last layer.*got \(1, 3\)"),
            ({"target_layer_ids": (-1, 2)}, r"got \(-1, 2\)"),
        ]
        for changes, needle in cases:
            with self.subTest(**changes):
                with self.assertRaisesRegex(ValueError, needle):
                    self._config(**changes)

    def test_engine_arguments(self):
        for kwargs, needle in (
            ({"speculative_num_draft_tokens": 0}, "must be an int >= 2, got 0"),
            ({"max_running_requests": 0}, "max_running_requests .* got 0"),
            ({"context_length": 10_000}, "context_length=10000"),
            ({"cuda_graph_bs": [1, 64]}, "cuda_graph_bs"),
        ):
            with self.subTest(**kwargs):
                with self.assertRaisesRegex(ValueError, needle):
                    Engine(speculative_algorithm="DSPARK", device="cpu", **kwargs)


if __name__ == "__main__":
    unittest.main()
