"""``python -m sglang.train_tiny_pair``: the training forwards compute what
inference computes; the distillation loss counts what verify accepts; the
joint target steps send the draft's gradient only through what the draft
reads; a tiny run end to end writes loadable checkpoints, and a resumed run
(by phase, or mid-phase from a snapshot) writes the same bytes."""

import contextlib
import io
import json
import os
import shutil
import tempfile
import threading
import unittest
from dataclasses import replace
from unittest import mock

import torch

from sglang import Engine
from sglang.srt.model_loader.loader import WEIGHTS_NAME
from sglang.srt.models.registry import init_random_weights
from sglang.srt.models.tiny_moe import TinyMoEConfig, TinyMoEForCausalLM
from sglang.srt.utils.common import MAX_NUM_THREADS
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase, umask
from sglang.train_tiny_pair.forward import draft_block_logits, target_forward
from sglang.train_tiny_pair.train import (
    DRAFT_NAME,
    PHASES,
    TARGET_NAME,
    TINY,
    TrainConfig,
    _generator,
    block_distill_loss,
    main,
    new_draft,
    save_whole,
    target_loss,
)

register_cpu_ci(est_time=20, suite="base-a-test-cpu")


class TestTrainingForwardMatchesEngine(CustomTestCase):
    """On the shipped pair: every target forward and every draft proposal the
    engine makes while decoding at temperature 1 is reproduced by the training
    forwards on the committed sequence (the draft teacher forced with the
    proposal's own tokens)."""

    def test_target_and_draft_logits(self):
        engine = Engine(
            speculative_algorithm="DSPARK",
            device="cpu",
            random_seed=5,
            speculative_verify_budget="off",  # whole blocks: rows are positions
        )
        worker = engine.worker
        runner, proposer = worker.target_worker.model_runner, worker.proposer
        targets, proposals = [], []
        run_target, propose = runner.forward, proposer.propose

        def target_spy(forward_batch):
            out = run_target(forward_batch)
            targets.append(
                (forward_batch.positions.clone(), forward_batch.input_ids.clone())
                + (out.logits.clone(),)
            )
            return out

        def propose_spy(*, views, mode, confidence=False, **extras):
            p = propose(views=views, mode=mode, confidence=confidence, **extras)
            start = int(views.window.positions[0, 0])
            # The Markov-corrected logits, [bs, gamma, V] (kept slot-major).
            logits = views.corrected.transpose(0, 1).clone()
            proposals.append((start, p.draft_tokens.clone(), logits))
            return p

        runner.forward, proposer.propose = target_spy, propose_spy
        prompt = list(b"import os\n\n\ndef main(argv):\n    for name in ")
        out = engine.generate(
            input_ids=[prompt], sampling_params={"max_new_tokens": 24, "temperature": 1}
        )
        seq = prompt + out[0]["output_ids"]
        target, draft = worker.target_worker.model, worker.draft_model
        layers, gamma = draft.config.target_layer_ids, worker.gamma
        self.assertGreater(len(targets), 3)
        self.assertGreater(len(proposals), 3)
        with torch.no_grad():
            for positions, ids, logits in targets:
                start = int(positions[0])
                rows = torch.tensor([seq[:start] + ids.tolist()])
                want, _ = target_forward(target, rows, capture=layers)
                torch.testing.assert_close(
                    want[0, start:], logits, atol=1e-4, rtol=1e-4
                )
            for start, tokens, logits in proposals:
                rows = torch.tensor([seq[: start + 1] + tokens[0, :-1].tolist()])
                _, aux = target_forward(target, rows, capture=layers)
                q = draft_block_logits(
                    draft,
                    aux_hidden=aux,
                    ids=rows,
                    anchors=torch.tensor([start]),
                    gamma=gamma,
                )
                torch.testing.assert_close(q[0, 0], logits[0], atol=1e-4, rtol=1e-4)


class TestDistillLoss(CustomTestCase):
    def setUp(self):
        super().setUp()
        g = torch.Generator().manual_seed(0)
        self.q = torch.randn(2, 3, 4, 7, generator=g)  # [B, A, gamma, vocab]
        self.p = torch.softmax(torch.randn(2, 3, 4, 7, generator=g), dim=-1)
        self.ce = -(self.p * torch.log_softmax(self.q, dim=-1)).sum(-1)  # [B, A, gamma]

    def test_slot_weights(self):
        loss = block_distill_loss(self.q, self.p, slot_decay=1.0, accept_weight=0.0)
        torch.testing.assert_close(loss, self.ce.mean())
        # decay 0.5 over 4 slots: weights 1, 1/2, 1/4, 1/8 normalized to mean 1
        w = torch.tensor([8.0, 4.0, 2.0, 1.0]) / 15 * 4
        loss = block_distill_loss(self.q, self.p, slot_decay=0.5, accept_weight=0.0)
        torch.testing.assert_close(loss, (self.ce * w).mean())

    def test_accept_term_is_expected_accepted_drafts(self):
        # Two slots over two tokens: acceptance sum min(p, q) = 0.8, then 0.6;
        # a block accepts 0.8 + 0.8 * 0.6 = 1.28 drafts on average.
        p = torch.tensor([[[[0.6, 0.4], [0.5, 0.5]]]])
        q = torch.tensor([[[[0.8, 0.2], [0.9, 0.1]]]]).log()
        with_term = block_distill_loss(q, p, slot_decay=0.5, accept_weight=2.0)
        without = block_distill_loss(q, p, slot_decay=0.5, accept_weight=0.0)
        torch.testing.assert_close(without - with_term, torch.tensor(2 * 1.28))
        # A draft equal to the target accepts every slot.
        exact = block_distill_loss(
            self.p.log(), self.p, slot_decay=1.0, accept_weight=1.0
        )
        entropy = -(self.p * self.p.log()).sum(-1).mean()
        torch.testing.assert_close(exact, entropy - 4)


class TestJointTargetLoss(CustomTestCase):
    def test_draft_gradient_reaches_only_what_the_draft_reads(self):
        cfg = TrainConfig()
        model = TinyMoEForCausalLM(TinyMoEConfig())
        init_random_weights(model, 0)
        draft = new_draft(cfg, model)
        g = torch.Generator().manual_seed(1)
        window = torch.randint(0, 255, (2, 41), generator=g)
        anchors = torch.tensor([8, 17, 30])

        def grads(**draft_args):
            model.zero_grad(set_to_none=True)
            draft.zero_grad(set_to_none=True)
            target_loss(model, window, cfg=cfg, **draft_args).backward()
            return {n: p.grad.clone() for n, p in model.named_parameters()}

        lm, joint = grads(), grads(draft=draft, anchors=anchors)
        self.assertIsNotNone(draft.fc.weight.grad)
        deepest = max(draft.config.target_layer_ids)
        for name in lm:
            layer = int(name.split(".")[1]) if name.startswith("layers.") else None
            with self.subTest(param=name):
                if name.startswith("norm.") or (layer is not None and layer > deepest):
                    # Past the layers the draft reads: the target's probabilities
                    # are detached, so only the LM loss reaches these.
                    torch.testing.assert_close(joint[name], lm[name])
                else:  # the layers it reads, and the shared embedding / LM head
                    self.assertFalse(torch.allclose(joint[name], lm[name]))


def _run(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["--tiny", *args])
    if rc != 0:
        raise AssertionError(f"train_tiny_pair exited with {rc}")
    return out.getvalue()


def _weights(output_dir: str) -> dict:
    out = {}
    for name in (TARGET_NAME, DRAFT_NAME):
        with open(os.path.join(output_dir, name, WEIGHTS_NAME), "rb") as f:
            out[name] = f.read()
    return out


class TestTrainTinyPair(CustomTestCase):
    def setUp(self):
        super().setUp()
        self.root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.root)

    def _dirs(self, name: str):
        return os.path.join(self.root, name, "out"), os.path.join(
            self.root, name, "work"
        )

    def test_end_to_end_and_resume(self):
        out, work = self._dirs("a")
        log = _run("--output-dir", out, "--work-dir", work)
        self.assertIn("target held-out loss:", log)
        self.assertIn("expected accepted length", log)
        self.assertIn("acceptance per block position 1..5", log)
        first = _weights(out)

        # The exported pair loads: bundled draft by default, or the draft alone.
        target_dir = os.path.join(out, TARGET_NAME)
        for draft_path in (None, os.path.join(out, DRAFT_NAME)):
            engine = Engine(
                model_path=target_dir,
                speculative_algorithm="DSPARK",
                speculative_draft_model_path=draft_path,
                device="cpu",
            )
            self.assertEqual(
                engine.server_args.speculative_draft_model_path,
                draft_path or target_dir,
            )
            spec = engine.generate(
                input_ids=[list(b"def f(x):\n")], sampling_params={"max_new_tokens": 9}
            )
            plain = Engine(model_path=target_dir, device="cpu").generate(
                input_ids=[list(b"def f(x):\n")], sampling_params={"max_new_tokens": 9}
            )
            self.assertEqual(spec[0]["output_ids"], plain[0]["output_ids"])

        # Phase by phase: the finished phase is reused, the same bytes result.
        out_b, work_b = self._dirs("b")
        _run("--output-dir", out_b, "--work-dir", work_b, "--phases", "target")
        self.assertFalse(os.path.exists(os.path.join(out_b, TARGET_NAME)))
        log = _run("--output-dir", out_b, "--work-dir", work_b)
        self.assertIn("target: done already", log)
        self.assertEqual(_weights(out_b), first)

        # Mid-phase: drop the finished target, keep its last snapshot.
        shutil.rmtree(os.path.join(work, "target"))
        shutil.rmtree(os.path.join(work, "draft"))
        log = _run("--output-dir", out, "--work-dir", work)
        self.assertIn("target: resuming at step 4", log)
        self.assertIn("draft: resuming at step", log)
        self.assertEqual(_weights(out), first)

        # A work dir is one configuration's: another seed is refused (it
        # would reuse the phases, or resume the snapshots, of this one).
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            rc = main(
                ["--tiny", "--seed", "1", "--output-dir", out, "--work-dir", work]
            )
        self.assertEqual(rc, 2)
        self.assertIn("holds a run of another configuration", err.getvalue())
        self.assertIn("'seed': (0, 1)", err.getvalue())
        self.assertEqual(_weights(out), first)

        # A save cut short (here: the export's second checkpoint, after the
        # first wrote its file) leaves the pair that was there, and no
        # half-written folder beside it.
        def save_file(tensors, path, metadata=None):
            if not written:
                written.append(path)
                with open(path, "wb") as f:
                    f.write(b"another target")
                return
            raise KeyboardInterrupt

        written, err = [], io.StringIO()
        with (
            mock.patch("safetensors.torch.save_file", save_file),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(err),
        ):
            argv = ["--output-dir", out, "--work-dir", work, "--phases", "export"]
            rc = main(["--tiny", *argv])
        self.assertEqual(rc, 130)  # Ctrl-C: what to rerun, no traceback
        self.assertEqual(
            err.getvalue().splitlines()[-1],
            f"train_tiny_pair: interrupted; the same command resumes from {work}",
        )
        self.assertEqual(len(written), 1)
        self.assertEqual(_weights(out), first)
        self.assertEqual(sorted(os.listdir(out)), sorted([TARGET_NAME, DRAFT_NAME]))

    def test_markov_rank_reaches_the_checkpoint(self):
        out, work = self._dirs("rank")
        _run("--output-dir", out, "--work-dir", work, "--markov-rank", "8")
        for name in (TARGET_NAME, DRAFT_NAME):
            with open(os.path.join(out, name, "config.json")) as f:
                self.assertEqual(json.load(f)["dspark_markov_rank"], 8)
        draft = Engine(
            model_path=os.path.join(out, TARGET_NAME),
            speculative_algorithm="DSPARK",
            device="cpu",
        ).worker.draft_model
        self.assertEqual(draft.markov_w1.weight.shape, (256, 8))
        self.assertEqual(draft.markov_w2.weight.shape, (256, 8))

    def test_saves_from_two_writers_both_land(self):
        # Runs of one seed and size share the default work dir: writers of
        # one path each write a file of their own, then rename it.
        path, errors = os.path.join(self.root, "distill.pt"), []

        def save(i):
            try:
                for _ in range(5):
                    save_whole({"seqs": torch.full((1 << 14,), i)}, path)
            except Exception as e:  # noqa: BLE001 - collected, asserted empty
                errors.append(e)

        threads = [threading.Thread(target=save, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        self.assertEqual(os.listdir(self.root), ["distill.pt"])
        seqs = torch.load(path)["seqs"]
        self.assertEqual(len(set(seqs.tolist())), 1)  # one writer's, whole

    def test_seeds_past_the_generators_range_wrap(self):
        # The phases' generators are seeded from the seed: near 2**63 the
        # product passes torch's 2**64, which must wrap, not overflow.
        for seed in (0, 2**62, 2**63 - 1):
            with self.subTest(seed=seed):
                gen = _generator(replace(TINY, seed=seed), "draft", 3)
                expected = ((seed * 7 + PHASES.index("draft")) * 1_000_003 + 3) % 2**64
                self.assertEqual(gen.initial_seed(), expected)

    def test_a_save_that_fails_leaves_nothing_at_its_path(self):
        # A rerun skips a phase whose output exists, so a save cut short
        # must leave none (nor its temporary); one that ends leaves it whole.
        path = os.path.join(self.root, "distill.pt")

        class Unpicklable:
            def __reduce__(self):
                raise KeyboardInterrupt  # as a Ctrl-C in the middle of the write

        with self.assertRaises(KeyboardInterrupt):
            save_whole({"seqs": torch.zeros(1 << 16), "later": Unpicklable()}, path)
        self.assertEqual(os.listdir(self.root), [])  # nor its temporary
        with umask(0o022):
            save_whole({"seqs": torch.arange(5)}, path)
        self.assertTrue(torch.equal(torch.load(path)["seqs"], torch.arange(5)))
        self.assertEqual(os.stat(path).st_mode & 0o777, 0o644)  # not mkstemp's 0600

    def test_bad_steps_are_rejected(self):
        a_file = os.path.join(self.root, "a_file")
        open(a_file, "w").close()
        for flag, value in (
            ("--target-steps", "0"),
            ("--draft-steps", "0"),
            ("--markov-rank", "0"),
            ("--num-threads", "0"),
            ("--num-threads", str(MAX_NUM_THREADS + 1)),  # far past: a crash
            ("--seed", str(2**63)),  # past the generator's seed
            ("--seed", "-1"),
            ("--output-dir", a_file),  # refused before any training
            ("--work-dir", a_file),
            # Folders that cannot be made: an OSError after the training before.
            ("--output-dir", os.path.join(a_file, "pair")),
            ("--work-dir", os.path.join(a_file, "work")),
        ):
            with (
                self.subTest(flag=flag, value=value),
                self.assertRaises(SystemExit) as cm,
                contextlib.redirect_stderr(io.StringIO()),
            ):
                main(["--tiny", flag, value])
            self.assertEqual(cm.exception.code, 2)
        # Checked, not made: a refused run leaves no folder behind.
        out, work = os.path.join(self.root, "out"), os.path.join(self.root, "work")
        with (
            self.assertRaises(SystemExit),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            main(["--tiny", "--work-dir", work, "--output-dir", out, "--seed", "-1"])
        with (
            self.assertRaises(SystemExit),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            main(["--tiny", "--work-dir", work, "--output-dir", a_file])
        self.assertFalse(os.path.exists(out) or os.path.exists(work))


if __name__ == "__main__":
    unittest.main()
