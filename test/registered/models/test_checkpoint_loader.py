"""Checkpoint directories (``srt/model_loader/loader.py``): a save/load round
trip gives identical logits; each malformed checkpoint is a ValueError naming
the file and the field or tensor; directories drive the engine's draft-path
defaulting like presets do."""

import contextlib
import json
import os
import shutil
import tempfile
import threading
import unittest
from unittest import mock

import torch
from safetensors.torch import load_file, save_file

from sglang import Engine
from sglang.srt.model_loader.loader import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    load_draft_checkpoint,
    load_target_checkpoint,
    replace_dir,
    save_checkpoint,
)
from sglang.srt.models.registry import get_hf_config, load_draft, load_target
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils import common
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase, umask
from sglang.train_tiny_pair.forward import draft_block_logits, target_forward

register_cpu_ci(est_time=8, suite="base-a-test-cpu")


def _bf16_rounded(module: torch.nn.Module) -> None:
    # What bf16 storage keeps: the round trip is then exact.
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())


class TestCheckpointLoader(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.root = tempfile.mkdtemp()
        cls.target = load_target("random-tiny-moe", seed=3, device="cpu")
        cls.draft = load_draft(
            "random-tiny-moe", target=cls.target, seed=3, device="cpu"
        )
        _bf16_rounded(cls.target)
        _bf16_rounded(cls.draft)
        cls.bundle = os.path.join(cls.root, "bundle")
        cls.draft_dir = os.path.join(cls.root, "draft")
        cls.plain_dir = os.path.join(cls.root, "plain")
        save_checkpoint(cls.bundle, target=cls.target, draft=cls.draft)
        save_checkpoint(cls.draft_dir, draft=cls.draft)
        save_checkpoint(cls.plain_dir, target=cls.target)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.root)
        super().tearDownClass()

    def _copy(self, src: str) -> str:
        dst = tempfile.mkdtemp(dir=self.root)
        shutil.rmtree(dst)
        shutil.copytree(src, dst)
        return dst

    def _edit_config(self, path: str, **changes) -> None:
        file = os.path.join(path, CONFIG_NAME)
        with open(file) as f:
            cfg = json.load(f)
        for k, v in changes.items():
            if v is None:
                del cfg[k]
            else:
                cfg[k] = v
        with open(file, "w") as f:
            json.dump(cfg, f)

    def _logits(self, target, draft, ids):
        logits, aux = target_forward(target, ids, capture=draft.config.target_layer_ids)
        q = draft_block_logits(
            draft, aux_hidden=aux, ids=ids, anchors=torch.tensor([4, 9]), gamma=5
        )
        return logits, q

    def test_round_trip_gives_identical_logits(self):
        ids = torch.randint(0, 255, (2, 16), generator=torch.Generator().manual_seed(0))
        want = self._logits(self.target, self.draft, ids)
        for draft_path in (self.bundle, self.draft_dir):
            with self.subTest(draft_path=os.path.basename(draft_path)):
                target = load_target_checkpoint(self.bundle, device="cpu")
                draft = load_draft_checkpoint(draft_path, target=target, device="cpu")
                got = self._logits(target, draft, ids)
                self.assertTrue(torch.equal(got[0], want[0]))
                self.assertTrue(torch.equal(got[1], want[1]))
                self.assertIs(draft.embed_tokens, target.embed_tokens)
                self.assertEqual(target.embed_tokens.weight.dtype, torch.float32)
        stored = load_file(os.path.join(self.bundle, WEIGHTS_NAME))
        self.assertTrue(all(t.dtype == torch.bfloat16 for t in stored.values()))
        # The draft's shared modules are the target's: never stored twice.
        self.assertNotIn("dspark.embed_tokens.weight", stored)
        self.assertIn("dspark.markov_w1.weight", stored)

    def test_hf_config_and_engine_defaults(self):
        cfg = get_hf_config(self.bundle)
        self.assertEqual(cfg.dspark_block_size, 5)
        self.assertEqual(cfg.dspark_target_layer_ids, [1, 2])
        args = ServerArgs(model_path=self.bundle, speculative_algorithm="DSPARK")
        self.assertEqual(args.speculative_draft_model_path, self.bundle)
        self.assertEqual(args.speculative_num_draft_tokens, 6)
        with self.assertRaisesRegex(ValueError, "bundles no DSpark draft"):
            ServerArgs(model_path=self.plain_dir, speculative_algorithm="DSPARK")
        engine = Engine(
            model_path=self.plain_dir,
            speculative_algorithm="DSPARK",
            speculative_draft_model_path=self.draft_dir,
            device="cpu",
        )
        self.assertEqual(engine.dspark_config.gamma, 5)
        out = engine.generate(
            input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 6}
        )
        self.assertEqual(len(out[0]["output_ids"]), 6)
        with self.assertRaisesRegex(ValueError, "not a target"):
            ServerArgs(model_path=self.draft_dir)

    def _assert_load_error(self, path, *needles, draft=False):
        with self.assertRaises(ValueError) as ctx:
            if draft:
                load_draft_checkpoint(path, target=self.target, device="cpu")
            else:
                load_target_checkpoint(path, device="cpu")
        for needle in needles:
            self.assertIn(needle, str(ctx.exception))

    def test_saves_replace_the_folder_whole(self):
        # Two threads saving one path (each stages in a folder of its own):
        # both finish, the folder loads, and no staging folder is left.
        parent = tempfile.mkdtemp(dir=self.root)
        path = os.path.join(parent, "ck")
        errors = []

        def save():
            try:
                save_checkpoint(path, draft=self.draft)
            except Exception as e:  # noqa: BLE001 - collected, asserted empty
                errors.append(e)

        threads = [threading.Thread(target=save) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        self.assertEqual(os.listdir(parent), ["ck"])
        load_draft_checkpoint(path, target=self.target, device="cpu")
        # A symlinked folder is refused (a rename would replace the link).
        link = os.path.join(parent, "link")
        os.symlink(path, link)
        with self.assertRaisesRegex(ValueError, "is a symlink"):
            save_checkpoint(link, draft=self.draft)

    def test_a_saved_folder_has_the_modes_made_in_place(self):
        # Staged by tempfile (0700, 0600) and renamed in: the folder and its
        # files end with the modes a plain makedirs and open give, as the
        # shipped pair has them (others can read what one user trained).
        # Without /proc (not Linux) the umask is read by setting it, and put
        # back.
        no_proc = mock.patch.object(common, "open", side_effect=OSError, create=True)
        for mask, proc in ((0o022, True), (0o077, True), (0o027, False)):
            with self.subTest(umask=oct(mask), proc=proc), umask(mask):
                path = os.path.join(tempfile.mkdtemp(dir=self.root), "ck")
                with contextlib.nullcontext() if proc else no_proc:
                    save_checkpoint(path, draft=self.draft)
                self.assertEqual(os.umask(mask), mask)
                modes = {
                    name: os.stat(os.path.join(path, name)).st_mode & 0o777
                    for name in ("", CONFIG_NAME, WEIGHTS_NAME)
                }
                want = 0o666 & ~mask
                self.assertEqual(
                    modes, {"": 0o777 & ~mask, CONFIG_NAME: want, WEIGHTS_NAME: want}
                )

    def test_a_writer_moving_the_folder_between_the_checks_and_the_rename(self):
        # The interleavings the threads above hit now and then, made certain:
        # another writer moves the old folder away right after this one saw
        # it, before its isdir check or before its own rename of it.
        for before in ("isdir", "rename"):
            with self.subTest(before=before):
                parent = tempfile.mkdtemp(dir=self.root)
                dst, src = os.path.join(parent, "ck"), os.path.join(parent, "new")
                os.makedirs(os.path.join(dst, "old_file"))
                os.makedirs(os.path.join(src, "new_file"))
                real = {"isdir": os.path.isdir, "rename": os.rename}
                moved = []

                def other_writer_first(*args, _name=before):
                    if not moved and args[0] == dst:
                        moved.append(os.path.join(parent, "elsewhere"))
                        real["rename"](dst, moved[0])
                    return real[_name](*args)

                target = "os.path.isdir" if before == "isdir" else "os.rename"
                with mock.patch(target, side_effect=other_writer_first):
                    replace_dir(src, dst)
                self.assertEqual(moved, [os.path.join(parent, "elsewhere")])
                self.assertEqual(os.listdir(dst), ["new_file"])
                self.assertEqual(sorted(os.listdir(parent)), ["ck", "elsewhere"])

    def test_missing_files(self):
        self._assert_load_error(
            os.path.join(self.root, "nope"), "nope", "does not exist"
        )
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            with self.subTest(name=name):
                path = self._copy(self.bundle)
                os.remove(os.path.join(path, name))
                self._assert_load_error(path, os.path.join(path, name), "missing")

    def test_unreadable_files(self):
        path = self._copy(self.bundle)
        with open(os.path.join(path, CONFIG_NAME), "w") as f:
            f.write("{not json")
        self._assert_load_error(path, CONFIG_NAME, "not valid JSON")
        path = self._copy(self.bundle)
        with open(os.path.join(path, WEIGHTS_NAME), "wb") as f:
            f.write(b"\x00" * 16)
        self._assert_load_error(path, WEIGHTS_NAME, "unreadable")

    def test_bad_config_fields(self):
        for changes, needles in (
            ({"architectures": ["LlamaForCausalLM"]}, ("'architectures'",)),
            ({"num_heads": None}, ("'num_heads'", "missing")),
            ({"hidden_size": "64"}, ("'hidden_size'", "'64'")),
            ({"dspark_markov_rank": None}, ("'dspark_markov_rank'",)),
            # Heads of an even size that split the hidden state: 64 / 5 do not.
            ({"num_heads": 5}, ("'num_heads' is 5", "hidden_size=64")),
            ({"num_heads": 128}, ("'num_heads' is 128",)),
            ({"top_k": 9}, ("'top_k' is 9", "num_experts=8")),
            ({"dspark_top_k": 5}, ("'dspark_top_k' is 5", "dspark_num_experts=4")),
            ({"torch_dtype": "float16"}, ("'torch_dtype' is 'float16'", "bfloat16")),
        ):
            with self.subTest(changes=changes):
                path = self._copy(self.bundle)
                self._edit_config(path, **changes)
                loading_draft = any(k.startswith("dspark_") for k in changes)
                self._assert_load_error(
                    path, CONFIG_NAME, *needles, draft=loading_draft
                )

    def test_config_does_not_match_tensors(self):
        weights = "model.safetensors"
        for changes, needles, draft in (
            ({"hidden_size": 32}, (weights, "hidden_size=32", "embed_tokens"), False),
            ({"num_layers": 5}, (weights, "'layers.4.", "num_layers=5"), False),
            ({"num_experts": 4}, (weights, "'layers.0.mlp.", "num_experts=4"), False),
            (
                {"moe_intermediate_size": 32},
                (weights, "moe_intermediate_size=32"),
                False,
            ),
            ({"dspark_markov_rank": 8}, (weights, "dspark_markov_rank=8"), True),
            ({"dspark_num_layers": 2}, (weights, "dspark_num_layers=2"), True),
            ({"dspark_target_layer_ids": [1]}, (weights, "dspark.fc.weight"), True),
            # Sizes no memory holds: refused by the shapes, before allocating.
            (
                {"vocab_size": 10**12},
                (weights, "embed_tokens", "vocab_size=1000000000000"),
                False,
            ),
        ):
            with self.subTest(changes=changes):
                path = self._copy(self.bundle)
                self._edit_config(path, **changes)
                self._assert_load_error(path, *needles, CONFIG_NAME, draft=draft)

    def _with_tensor(self, src: str, name: str) -> str:
        """A copy of checkpoint ``src`` with one more tensor, ``name``."""
        path = self._copy(src)
        file = os.path.join(path, WEIGHTS_NAME)
        tensors = load_file(file)
        tensors[name] = torch.zeros(2, dtype=torch.bfloat16)
        save_file(tensors, file)
        return path

    def test_tensors_in_another_dtype(self):
        # The format stores bf16: another float (fp8 among them, which the
        # finiteness check cannot read) is refused, naming the tensor.
        for draft, name in ((False, "lm_head.weight"), (True, "dspark.fc.weight")):
            for dtype in (torch.float16, torch.float32, torch.float8_e4m3fn):
                with self.subTest(tensor=name, dtype=dtype):
                    path = self._copy(self.bundle)
                    file = os.path.join(path, WEIGHTS_NAME)
                    tensors = load_file(file)
                    tensors[name] = tensors[name].to(dtype)
                    save_file(tensors, file)
                    self._assert_load_error(
                        path,
                        WEIGHTS_NAME,
                        f"tensor {name!r} has dtype {dtype}",
                        "store torch.bfloat16",
                        draft=draft,
                    )

    def test_unexpected_tensors(self):
        path = self._with_tensor(self.bundle, "layers.9.extra")
        self._assert_load_error(
            path, WEIGHTS_NAME, "unexpected tensor 'layers.9.extra'"
        )
        # Draft tensors in a target whose config bundles no draft.
        path = self._copy(self.bundle)
        self._edit_config(
            path,
            **{k: None for k in vars(get_hf_config(path)) if k.startswith("dspark_")},
        )
        self._assert_load_error(path, WEIGHTS_NAME, "unexpected tensor 'dspark.")
        # Anything but the draft's own tensors in a draft-only checkpoint.
        path = self._with_tensor(self.draft_dir, "embed_tokens.weight")
        self._assert_load_error(
            path, WEIGHTS_NAME, "unexpected tensor 'embed_tokens.weight'", draft=True
        )

    def test_the_draft_loads_in_its_targets_dtype(self):
        # It shares the target's embedding and LM head: another dtype would
        # cast them under the target.
        target = load_target_checkpoint(self.bundle, device="cpu")
        with self.assertRaisesRegex(ValueError, "load both in one dtype"):
            load_draft_checkpoint(
                self.bundle, target=target, device="cpu", dtype=torch.bfloat16
            )
        self.assertEqual(target.embed_tokens.weight.dtype, torch.float32)

    def test_draft_must_fit_the_target(self):
        for changes, needles in (
            ({"hidden_size": 32}, ("'hidden_size' is 32", "hidden_size=64")),
            ({"vocab_size": 128}, ("'vocab_size' is 128", "vocab_size=256")),
            (
                {"dspark_target_layer_ids": [1, 3]},
                ("'dspark_target_layer_ids'", "num_layers=4"),
            ),
            (
                {"dspark_noise_token_id": 300},
                ("'dspark_noise_token_id'", "vocab_size=256"),
            ),
            (
                {"dspark_target_layer_ids": [1, 1]},
                ("'dspark_target_layer_ids'", "strictly increasing"),
            ),
        ):
            with self.subTest(changes=changes):
                path = self._copy(self.draft_dir)
                self._edit_config(path, **changes)
                self._assert_load_error(path, CONFIG_NAME, *needles, draft=True)


if __name__ == "__main__":
    unittest.main()
