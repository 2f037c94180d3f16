"""Draft-path defaulting (``arg_groups/speculative_hook.py``), upstream's cases:
a bundled config is detected, a plain target is not, the draft path defaults
to the model path with a verify width of block + 1, a plain target without a
draft path raises, an explicit path is kept."""

import unittest
from types import SimpleNamespace

from sglang import Engine
from sglang.srt.arg_groups.speculative_hook import (
    _handle_dspark,
    _target_checkpoint_bundles_dspark_draft,
)
from sglang.srt.models.registry import (
    TRAINED_DRAFT_PATH,
    TRAINED_TARGET_PATH,
    get_draft_config,
)
from sglang.srt.server_args import ServerArgs
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

_BUNDLED_MODEL_PATH = "deepseek-ai/DeepSeek-V4-Flash-DSpark"
_PLAIN_MODEL_PATH = "deepseek-ai/DeepSeek-V4-Flash"


def _bundled_hf_config() -> SimpleNamespace:
    return SimpleNamespace(
        architectures=["DeepseekV4ForCausalLM"],
        dspark_block_size=5,
        dspark_markov_rank=256,
        dspark_target_layer_ids=[40, 41, 42],
        dspark_noise_token_id=128799,
    )


def _plain_hf_config() -> SimpleNamespace:
    return SimpleNamespace(architectures=["DeepseekV4ForCausalLM"])


def _make_dspark_server_args(*, model_path: str, hf_config) -> ServerArgs:
    # Built on the embedded default, then pointed at a foreign checkpoint's
    # config the way upstream's test does (no download, no weights).
    server_args = ServerArgs()
    server_args.model_path = model_path
    server_args.speculative_algorithm = "DSPARK"
    server_args.speculative_draft_model_path = None
    server_args.speculative_num_draft_tokens = None
    server_args._model_config = SimpleNamespace(hf_config=hf_config)
    return server_args


class TestTargetCheckpointBundlesDsparkDraft(CustomTestCase):
    def test_bundled_dsv4_config_is_detected(self):
        server_args = _make_dspark_server_args(
            model_path=_BUNDLED_MODEL_PATH, hf_config=_bundled_hf_config()
        )
        self.assertTrue(_target_checkpoint_bundles_dspark_draft(server_args))

    def test_plain_target_config_is_not_detected(self):
        server_args = _make_dspark_server_args(
            model_path=_PLAIN_MODEL_PATH, hf_config=_plain_hf_config()
        )
        self.assertFalse(_target_checkpoint_bundles_dspark_draft(server_args))

    def test_a_partial_config_is_not_a_bundle(self):
        cfg = _bundled_hf_config()
        del cfg.dspark_noise_token_id
        server_args = _make_dspark_server_args(
            model_path=_BUNDLED_MODEL_PATH, hf_config=cfg
        )
        self.assertFalse(_target_checkpoint_bundles_dspark_draft(server_args))


class TestDsparkDraftPathDefaulting(CustomTestCase):
    def test_bundled_checkpoint_defaults_draft_path_to_model_path(self):
        server_args = _make_dspark_server_args(
            model_path=_BUNDLED_MODEL_PATH, hf_config=_bundled_hf_config()
        )
        _handle_dspark(server_args)
        self.assertEqual(server_args.speculative_draft_model_path, _BUNDLED_MODEL_PATH)
        self.assertEqual(server_args.speculative_num_draft_tokens, 6)

    def test_plain_target_without_draft_path_raises(self):
        server_args = _make_dspark_server_args(
            model_path=_PLAIN_MODEL_PATH, hf_config=_plain_hf_config()
        )
        with self.assertRaisesRegex(ValueError, "bundles no DSpark draft"):
            _handle_dspark(server_args)

    def test_explicit_draft_path_is_not_overwritten(self):
        server_args = _make_dspark_server_args(
            model_path=_BUNDLED_MODEL_PATH, hf_config=_bundled_hf_config()
        )
        server_args.speculative_draft_model_path = "random-tiny-moe-dspark-b3"
        _handle_dspark(server_args)
        self.assertEqual(
            server_args.speculative_draft_model_path, "random-tiny-moe-dspark-b3"
        )
        self.assertEqual(server_args.speculative_num_draft_tokens, 4)


class TestEmbeddedPair(CustomTestCase):
    def test_server_args_default_to_the_bundled_draft(self):
        # The default is the shipped, trained checkpoint directory.
        args = ServerArgs(speculative_algorithm="DSPARK")
        self.assertEqual(args.model_path, TRAINED_TARGET_PATH)
        self.assertEqual(args.speculative_draft_model_path, TRAINED_TARGET_PATH)
        block = get_draft_config(TRAINED_TARGET_PATH).block_size
        self.assertEqual(block, 5)
        self.assertEqual(args.speculative_num_draft_tokens, block + 1)
        self.assertEqual(args.speculative_dspark_block_size, block)
        self.assertIsNone(ServerArgs().speculative_dspark_block_size)  # plain

    def test_engine_uses_the_bundled_pair(self):
        engine = Engine(speculative_algorithm="DSPARK", device="cpu")
        self.assertEqual(
            engine.server_args.speculative_draft_model_path, TRAINED_TARGET_PATH
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

    def test_explicit_width_kept_when_it_fits(self):
        args = ServerArgs(
            speculative_algorithm="DSPARK", speculative_num_draft_tokens=6
        )
        self.assertEqual(args.speculative_num_draft_tokens, 6)

    def test_separate_draft_and_its_block(self):
        args = ServerArgs(
            speculative_algorithm="DSPARK",
            speculative_draft_model_path="random-tiny-moe-dspark-b3",
        )
        self.assertEqual(args.speculative_draft_model_path, "random-tiny-moe-dspark-b3")
        self.assertEqual(args.speculative_num_draft_tokens, 4)
        engine = Engine(
            speculative_algorithm="DSPARK",
            speculative_draft_model_path="random-tiny-moe-dspark-b3",
            device="cpu",
        )
        self.assertEqual(engine.dspark_config.gamma, 3)

    def test_separate_draft_directory(self):
        # The shipped draft alone, beside a target that bundles none.
        args = ServerArgs(
            model_path="random-tiny-moe-nodraft",
            speculative_algorithm="DSPARK",
            speculative_draft_model_path=TRAINED_DRAFT_PATH,
        )
        self.assertEqual(args.speculative_draft_model_path, TRAINED_DRAFT_PATH)
        self.assertEqual(args.speculative_num_draft_tokens, 6)
        with self.assertRaisesRegex(ValueError, "is a DSpark draft, not a target"):
            ServerArgs(model_path="random-tiny-moe-dspark-b3")

    def test_bad_widths_name_both_numbers(self):
        for width, needle in (
            (1, "must be an int >= 2, got 1"),
            (0, "must be an int >= 2, got 0"),
            (True, "must be an int >= 2, got True"),
            (
                5,
                "speculative_num_draft_tokens=5 .* block size is 5, so the verify "
                "width must be 6",
            ),
            (4, "speculative_num_draft_tokens=4 .* block size is 5"),
        ):
            with self.subTest(width=width):
                with self.assertRaisesRegex(ValueError, needle):
                    ServerArgs(
                        speculative_algorithm="DSPARK",
                        speculative_num_draft_tokens=width,
                    )

    def test_target_without_draft_is_a_clear_error(self):
        with self.assertRaisesRegex(
            ValueError, "random-tiny-moe-nodraft.*bundles no DSpark draft"
        ):
            ServerArgs(
                model_path="random-tiny-moe-nodraft", speculative_algorithm="DSPARK"
            )
        args = ServerArgs(
            model_path="random-tiny-moe-nodraft",
            speculative_algorithm="DSPARK",
            speculative_draft_model_path="random-tiny-moe",
        )
        self.assertEqual(args.speculative_draft_model_path, "random-tiny-moe")
        self.assertEqual(args.speculative_num_draft_tokens, 6)
        plain = ServerArgs(model_path="random-tiny-moe-nodraft")
        self.assertIsNone(plain.speculative_draft_model_path)
        self.assertIsNone(plain.speculative_num_draft_tokens)

    def test_unknown_names(self):
        with self.assertRaisesRegex(ValueError, "unknown model path 'nope'"):
            ServerArgs(
                speculative_algorithm="DSPARK", speculative_draft_model_path="nope"
            )
        with self.assertRaisesRegex(ValueError, "not a DSpark draft"):
            ServerArgs(
                model_path="random-tiny-moe",
                speculative_algorithm="DSPARK",
                speculative_draft_model_path="random-tiny-moe-nodraft",
            )
        with self.assertRaisesRegex(ValueError, "unknown model path 'nope'"):
            ServerArgs(model_path="nope")
        with self.assertRaisesRegex(ValueError, "EAGLE9"):
            ServerArgs(speculative_algorithm="EAGLE9")


if __name__ == "__main__":
    unittest.main()
