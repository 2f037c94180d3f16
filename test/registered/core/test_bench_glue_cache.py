"""bench_glue_cache times the engine's own accept phase warm and cold."""

import contextlib
import io
import unittest

from sglang.bench_glue_cache import main, probe
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=40, suite="base-a-test-cpu")


class TestGlueCacheProbe(CustomTestCase):
    def test_reports_each_way_and_its_ratio_to_warm(self):
        for temperature in (0.0, 1.0):
            with self.subTest(temperature=temperature):
                out = probe(temperature=temperature, batch_size=2, trials=12)
                ways = {"warm", "after verify forward", "after 16 MB sweep"}
                self.assertEqual(set(out["accept_us"]), ways)
                self.assertEqual(set(out["ratio_to_warm"]), ways - {"warm"})
                for us in out["accept_us"].values():
                    self.assertGreater(us, 0.0)
                for ratio in out["ratio_to_warm"].values():
                    lo, hi = ratio["ci95"]
                    self.assertLessEqual(lo, ratio["median"])
                    self.assertLessEqual(ratio["median"], hi)
                    self.assertGreater(lo, 0.0)

    def test_compiled_accept_leaves_eagers_results_and_is_timed(self):
        # AOTInductor compiles the engine's own accept over its buffers: from
        # the same state it leaves the same accept lengths and bonus, and it
        # is timed each way beside eager.
        ways = {"warm", "after verify forward", "after 16 MB sweep"}
        for temperature, bs in ((0.0, 2), (1.0, 1)):
            with self.subTest(temperature=temperature, batch_size=bs):
                out = probe(
                    temperature=temperature, batch_size=bs, trials=10, compiled=True
                )
                self.assertIs(out["compiled_same_as_eager"], True)
                self.assertEqual(set(out["compiled_accept_us"]), ways)
                self.assertEqual(set(out["compiled_to_eager"]), ways)
                for ratio in out["compiled_to_eager"].values():
                    lo, hi = ratio["ci95"]
                    self.assertLessEqual(lo, ratio["median"])
                    self.assertLessEqual(ratio["median"], hi)
                    self.assertGreater(lo, 0.0)

    def test_bad_arguments_are_refused(self):
        for kwargs, message in (
            (dict(trials=5), "trials"),
            (dict(batch_size=0), "batch_size"),
            (dict(temperature=-1.0), "temperature"),
            (dict(batch_size=2, compiled=True), "batch size 1 only"),
        ):
            args = dict(temperature=1.0, batch_size=1, trials=12) | kwargs
            with self.subTest(**kwargs), self.assertRaisesRegex(ValueError, message):
                probe(**args)
        # The command line refuses before the run what the run would not
        # take, or could not save.
        for argv, says in (
            (["--temperature", "nan"], "--temperature"),
            (["--temperature", "1e31"], "--temperature"),
            (["--json", "/nonexistent-folder/out.json"], "does not exist"),
            (["--batch-size", "0"], "--batch-size"),
            (["--batch-size", "2", "--compiled"], "batch size 1 only"),
        ):
            err = io.StringIO()
            with self.subTest(argv=argv), contextlib.redirect_stderr(err):
                with self.assertRaises(SystemExit) as caught:
                    main(argv)
                self.assertEqual(caught.exception.code, 2)
                self.assertIn(says, err.getvalue())
        # What the engine refuses (a KV pool past memory): one error line.
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(main(["--batch-size", str(10**7)]), 2)
        self.assertRegex(err.getvalue(), r"^bench_glue_cache: error: the pools need")
        self.assertNotIn("Traceback", err.getvalue())

    def test_every_request_of_the_batch_decodes(self):
        # 12 requests of 420 KV slots each: all decoding while timed (a
        # pool of 4096 slots held 9; the other rows' buffers were stale).
        out = probe(temperature=0.0, batch_size=12, trials=10)
        self.assertEqual((out["batch_size"], out["requests_decoding"]), (12, 12))


if __name__ == "__main__":
    unittest.main()
