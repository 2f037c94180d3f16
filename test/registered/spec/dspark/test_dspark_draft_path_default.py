"""Draft defaults: a DSpark engine with no draft given takes the target's
bundled draft and that draft's gamma; explicit values are never overwritten."""

import unittest

from sglang import Engine
from sglang.srt.models.registry import get_draft_config
from sglang.srt.server_args import ServerArgs
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")


class TestDraftPathDefault(CustomTestCase):
    def test_bundled_draft_and_its_gamma(self):
        args = ServerArgs(speculative_algorithm="DSPARK")
        self.assertEqual(args.model_path, "tiny-moe")
        self.assertEqual(args.speculative_draft_model_path, "tiny-moe-dspark")
        self.assertEqual(
            args.speculative_num_draft_tokens,
            get_draft_config("tiny-moe-dspark").block_size,
        )
        self.assertEqual(args.speculative_num_draft_tokens, 5)

    def test_engine_uses_the_bundled_pair(self):
        engine = Engine(speculative_algorithm="DSPARK", device="cpu")
        self.assertEqual(
            engine.server_args.speculative_draft_model_path, "tiny-moe-dspark"
        )
        self.assertEqual(engine.dspark_config.gamma, 5)
        self.assertEqual(engine.worker.proposer.gamma, 5)
        # The draft shares the target's embedding and LM head, not copies.
        target = engine.worker.target_worker.model
        self.assertIs(engine.worker.draft_model.embed_tokens, target.embed_tokens)
        self.assertIs(engine.worker.draft_model.lm_head, target.lm_head)
        out = engine.generate(
            input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 7}
        )
        self.assertEqual(len(out[0]["output_ids"]), 7)

    def test_explicit_gamma_kept(self):
        args = ServerArgs(
            speculative_algorithm="DSPARK", speculative_num_draft_tokens=3
        )
        self.assertEqual(args.speculative_num_draft_tokens, 3)
        self.assertEqual(args.speculative_draft_model_path, "tiny-moe-dspark")
        engine = Engine(
            speculative_algorithm="DSPARK", speculative_num_draft_tokens=2, device="cpu"
        )
        self.assertEqual(engine.dspark_config.gamma, 2)

    def test_explicit_draft_kept_and_its_gamma_used(self):
        args = ServerArgs(
            speculative_algorithm="DSPARK",
            speculative_draft_model_path="tiny-moe-dspark-b3",
        )
        self.assertEqual(args.speculative_draft_model_path, "tiny-moe-dspark-b3")
        self.assertEqual(args.speculative_num_draft_tokens, 3)
        both = ServerArgs(
            speculative_algorithm="DSPARK",
            speculative_draft_model_path="tiny-moe-dspark-b3",
            speculative_num_draft_tokens=6,
        )
        self.assertEqual(
            (both.speculative_draft_model_path, both.speculative_num_draft_tokens),
            ("tiny-moe-dspark-b3", 6),
        )

    def test_target_without_draft_is_a_clear_error(self):
        with self.assertRaisesRegex(
            ValueError, "tiny-moe-nodraft.*bundles no DSpark draft"
        ):
            ServerArgs(model_path="tiny-moe-nodraft", speculative_algorithm="DSPARK")
        args = ServerArgs(
            model_path="tiny-moe-nodraft",
            speculative_algorithm="DSPARK",
            speculative_draft_model_path="tiny-moe-dspark",
        )
        self.assertEqual(args.speculative_draft_model_path, "tiny-moe-dspark")
        plain = ServerArgs(model_path="tiny-moe-nodraft")
        self.assertIsNone(plain.speculative_draft_model_path)
        self.assertIsNone(plain.speculative_num_draft_tokens)

    def test_unknown_names(self):
        with self.assertRaisesRegex(ValueError, "unknown draft model path 'nope'"):
            ServerArgs(
                speculative_algorithm="DSPARK", speculative_draft_model_path="nope"
            )
        with self.assertRaisesRegex(ValueError, "unknown model path 'nope'"):
            ServerArgs(model_path="nope")
        with self.assertRaisesRegex(ValueError, "EAGLE9"):
            ServerArgs(speculative_algorithm="EAGLE9")


if __name__ == "__main__":
    unittest.main()
