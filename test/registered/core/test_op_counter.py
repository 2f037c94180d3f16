"""OpCounter counts what torch dispatches (ops, allocations, host reads);
PhaseSpans and PhaseRecorder observe named spans of the code that runs,
without patching it."""

import time
import unittest

import torch

from sglang.srt.utils.op_counter import OpCounter
from sglang.srt.utils.phases import PhaseRecorder, PhaseSpans
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=1, suite="base-a-test-cpu")
register_cuda_ci(est_time=1, stage="base-b", runner_config="1-gpu-large")


class TestOpCounter(CustomTestCase):
    def test_ops_allocations_and_views(self):
        x, out = torch.ones(4), torch.zeros(4)
        with OpCounter() as c:
            y = x * 2  # a new tensor
            torch.add(x, y, out=out)  # written in place: no allocation
            out.view(2, 2)  # a view: an op, no allocation
        self.assertEqual((c.ops, c.allocs), (3, 1))
        self.assertEqual(c.by_op["aten::mul.Tensor"], 1)

    def test_an_op_that_reallocates_its_output_allocates(self):
        # An out= buffer of the wrong size, or a resize_ past the storage,
        # gets new storage under the same tensor; one of the right size
        # does not.
        x, right, empty, small = (
            torch.ones(4),
            torch.zeros(4),
            torch.empty(0),
            torch.zeros(2),
        )
        with OpCounter() as c:
            torch.add(x, 1, out=right)
        with OpCounter() as d:
            torch.add(x, 1, out=empty)
            small.resize_(1 << 16)
        # Pointed at a storage that exists: nothing new.
        z = torch.empty(0)
        with OpCounter() as e:
            z.set_(x.untyped_storage(), 0, (4,), (1,))
        self.assertEqual((c.allocs, d.allocs, e.allocs), (0, 2, 0))

    def test_host_reads(self):
        x = torch.arange(6)
        with OpCounter() as c:
            int(x.max())  # max, then _local_scalar_dense
            x.nonzero()
            torch.equal(x, x)
            bool(x[0])
            x.sum()  # stays a tensor: no read
        self.assertEqual(c.host_reads, 4)
        self.assertEqual(c.counts()["host_reads"], 4)

    def test_reads_inside_a_kernel(self):
        # Ops whose output size or result comes from data, read inside the
        # kernel (no nonzero or item dispatched): one read each. Index and
        # repeat by positions, or with the size given, read nothing.
        x, mask, reps = torch.arange(6.0), torch.arange(6) > 2, torch.tensor([1, 2])
        for name, read, fn in (
            ("x[mask]", 1, lambda: x[mask]),
            ("x[mask] = values", 1, lambda: x.clone().__setitem__(mask, x[:3])),
            (
                "x.index_put_((mask,), 1, accumulate=True)",
                1,
                lambda: x.clone().index_put_((mask,), torch.tensor(1.0), True),
            ),
            (
                "x[mask] = 0 (a masked_fill)",
                0,
                lambda: x.clone().__setitem__(mask, 0.0),
            ),
            ("allclose", 1, lambda: torch.allclose(x, x)),
            ("bincount", 1, lambda: torch.bincount(reps)),  # its length
            ("repeat_interleave(reps)", 1, lambda: torch.repeat_interleave(reps)),
            ("x.repeat_interleave(reps)", 1, lambda: x[:2].repeat_interleave(reps)),
            ("x[positions]", 0, lambda: x[torch.tensor([0, 2])]),
            ("x[positions] = 0", 0, lambda: x.clone().index_put_((reps,), x[:2])),
            (
                "repeat_interleave(reps, output_size=3)",
                0,
                lambda: x[:2].repeat_interleave(reps, output_size=3),
            ),
        ):
            with self.subTest(name):
                with OpCounter() as c:
                    fn()
                self.assertEqual(c.host_reads, read)

    def test_reads_of_cpu_memory_that_dispatch_nothing(self):
        # A CPU tensor's .tolist() / .numpy() / numpy.asarray() read its
        # memory with no aten op; they count once each, .item() once (its
        # op), and nothing stays counting after the counter closes.
        import numpy as np

        x = torch.arange(6)
        with OpCounter() as c:
            x.tolist()
            x.numpy()
            np.asarray(x)
            x[0].item()
            x.add(1)  # no read
        self.assertEqual(c.host_reads, 4)
        x.tolist()
        self.assertEqual(c.host_reads, 4)
        with OpCounter() as d:  # a second counter starts from zero
            x[1:].tolist()
        self.assertEqual((c.host_reads, d.host_reads), (4, 1))

    def test_int32_scalars(self):
        with OpCounter() as c:
            torch.tensor(3, dtype=torch.int32)
            torch.zeros((), dtype=torch.int32)
            torch.zeros(2, dtype=torch.int32)  # not 0-dim
        self.assertEqual(c.int32_scalars, 2)
        self.assertEqual(c.int32_scalar_sites, ["aten::lift_fresh", "aten::zeros"])

    @unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
    def test_copies_to_and_from_the_device(self):
        host = torch.ones(4)
        with OpCounter() as c:
            dev = host.to("cuda")
            dev.cpu()
        self.assertEqual((c.h2d_copies, c.host_reads), (1, 1))


class TestPhaseSpans(CustomTestCase):
    def test_no_hook_is_a_shared_noop(self):
        spans = PhaseSpans()
        self.assertIs(spans("a"), spans("b"))
        with spans("a"):
            pass

    def test_recorder_times_and_counts_nested_spans(self):
        spans, x = PhaseSpans(), torch.ones(3)
        with OpCounter() as c:
            spans.hook = recorder = PhaseRecorder(counter=c)
            for _ in range(2):
                with spans("outer"):
                    x.add(1)
                    with spans("inner"):
                        x.mul(2)
                        time.sleep(0.002)
                x.sub(1)  # outside every span
            spans.hook = None
        totals = recorder.totals
        self.assertEqual(totals["outer"]["ops"], 4)  # its own and inner's
        self.assertEqual(totals["inner"]["ops"], 2)
        self.assertEqual(totals["inner"]["allocs"], 2)
        self.assertEqual(c.ops - totals["outer"]["ops"], 2)
        self.assertGreaterEqual(totals["inner"]["seconds"], 0.004)
        self.assertGreaterEqual(totals["outer"]["seconds"], totals["inner"]["seconds"])

    def test_a_span_that_raises_is_still_closed(self):
        spans = PhaseSpans()
        spans.hook = recorder = PhaseRecorder(sync=lambda: None)
        with self.assertRaises(KeyError):
            with spans("a"):
                raise KeyError("inside")
        self.assertGreater(recorder.totals["a"]["seconds"], 0)
        self.assertNotIn("ops", recorder.totals["a"])  # no counter given

    def test_a_timing_only_recorder_times_nested_and_raising_spans(self):
        spans = PhaseSpans()
        spans.hook = recorder = PhaseRecorder()  # no sync, no counter
        for _ in range(2):
            with spans("outer"):
                with spans("inner"):
                    time.sleep(0.002)
        with self.assertRaises(KeyError):
            with spans("raised"):
                time.sleep(0.002)
                raise KeyError("inside")
        totals = recorder.totals
        self.assertEqual(set(totals), {"outer", "inner", "raised"})
        self.assertEqual(set(totals["inner"]), {"seconds"})
        self.assertGreaterEqual(totals["inner"]["seconds"], 0.004)
        self.assertGreaterEqual(totals["outer"]["seconds"], totals["inner"]["seconds"])
        self.assertGreaterEqual(totals["raised"]["seconds"], 0.002)
        self.assertIs(recorder("inner"), recorder("inner"))  # one span per name


if __name__ == "__main__":
    unittest.main()
