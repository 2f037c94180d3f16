"""bench_stats: the paired ratios the benches report, and their intervals."""

import math
import random
import statistics
import unittest

from sglang.bench_stats import (
    geometric_mean_ratio,
    mean_product,
    mean_ratio,
    median_ratio,
    t_quantile_975,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=1, suite="base-a-test-cpu")

PAIRS = [(1.0, 2.0), (2.0, 4.4), (1.5, 2.7), (3.0, 6.6), (1.0, 1.9)]


class TestBenchStats(CustomTestCase):
    def test_t_quantile(self):
        # Student's t 97.5% points from the tables.
        for df, t in ((2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042), (120, 1.980)):
            with self.subTest(df=df):
                self.assertAlmostEqual(t_quantile_975(df), t, delta=0.04)
        for df in (0, 1):  # df 1 (12.706) is past the series' reach: 11.3
            with self.subTest(df=df), self.assertRaises(ValueError):
                t_quantile_975(df)

    def test_geometric_mean_ratio(self):
        ratio, lo, hi = geometric_mean_ratio(PAIRS)
        logs = [math.log(b / a) for a, b in PAIRS]
        self.assertAlmostEqual(ratio, math.exp(statistics.fmean(logs)))
        half = 2.776 * statistics.stdev(logs) / math.sqrt(5)  # t(0.975, df=4)
        self.assertAlmostEqual(lo, ratio * math.exp(-half), places=2)
        self.assertAlmostEqual(hi, ratio * math.exp(half), places=2)
        # Scaling one variant's times scales the ratio and its interval.
        scaled = geometric_mean_ratio([(a, 3 * b) for a, b in PAIRS])
        for x, y in zip(scaled, (ratio, lo, hi)):
            self.assertAlmostEqual(x, 3 * y)

    def test_mean_ratio(self):
        ratio, lo, hi = mean_ratio(PAIRS)
        self.assertAlmostEqual(ratio, 17.6 / 8.5)  # sum(b) / sum(a)
        res = [b - ratio * a for a, b in PAIRS]
        se = math.sqrt(sum(r * r for r in res) / 4 / 5) / 1.7  # mean(a) = 1.7
        self.assertAlmostEqual(hi - ratio, 2.776 * se, places=2)
        self.assertAlmostEqual(ratio - lo, hi - ratio)
        # A long step weighs by its time, not by its log ratio.
        skew = [(1.0, 2.0)] * 9 + [(1.0, 20.0)]
        self.assertAlmostEqual(mean_ratio(skew)[0], 3.8)
        self.assertLess(geometric_mean_ratio(skew)[0], 2.6)

    def test_constant_ratio_and_too_few_pairs(self):
        for fn in (mean_ratio, geometric_mean_ratio):
            with self.subTest(fn=fn.__name__):
                for x in fn([(1.0, 1.5), (2.0, 3.0), (4.0, 6.0)]):
                    self.assertAlmostEqual(x, 1.5)  # no spread: zero width
                _, lo, hi = fn([(1.0, 2.0), (1.0, 3.0)])
                self.assertEqual((lo, hi), (None, None))
        self.assertAlmostEqual(geometric_mean_ratio([(1, 2), (1, 3)])[0], math.sqrt(6))
        self.assertEqual(mean_ratio([(1.0, 2.0), (1.0, 3.0)]), (2.5, None, None))

    def test_mean_product(self):
        # Two columns, powers (1, -1): mean_ratio's estimate, and an interval
        # on the log (asymmetric) of about mean_ratio's width.
        b, a = [p[1] for p in PAIRS], [p[0] for p in PAIRS]
        ratio, lo, hi = mean_product([b, a], [1, -1])
        self.assertAlmostEqual(ratio, mean_ratio(PAIRS)[0])
        res = [y / statistics.fmean(b) - x / statistics.fmean(a) for x, y in PAIRS]
        half = 2.776 * statistics.stdev(res) / math.sqrt(5)
        self.assertAlmostEqual(lo, ratio * math.exp(-half), places=2)
        self.assertAlmostEqual(hi, ratio * math.exp(half), places=2)
        self.assertAlmostEqual(hi - lo, mean_ratio(PAIRS)[2] - mean_ratio(PAIRS)[1], 1)
        # A speedup: (tokens_b / steps_b) / (tokens_a / steps_a) / cost ratio.
        # With the step costs constant, a cost-only interval has no width;
        # this one carries the tokens' spread.
        tokens_b, steps = [40, 52, 45, 38, 49], [10] * 5
        est, lo, hi = mean_product(
            [tokens_b, steps, [10] * 5, steps, [2.0] * 5, [1.0] * 5],
            [1, -1, -1, 1, -1, 1],
        )
        self.assertAlmostEqual(est, (44.8 / 10) / 1.0 / 2.0)
        self.assertLess(lo, est * 0.95)
        self.assertGreater(hi, est * 1.05)
        self.assertEqual(
            mean_product([[1.0, 2.0], [1.0, 2.0]], [1, -1]), (1, None, None)
        )

    def test_mean_product_covers_95_percent(self):
        # Simulated lockstep runs: the interval holds the true speedup (2.0)
        # in about 95% of 400 runs of 30 pairs, where tokens and times vary.
        rng, hits = random.Random(0), 0
        for _ in range(400):
            tokens = [rng.gauss(60, 9) for _ in range(30)]
            cost_a = [rng.gauss(1.0, 0.1) for _ in range(30)]
            cost_b = [c * rng.gauss(1.5, 0.1) for c in cost_a]  # correlated
            _, lo, hi = mean_product(
                [tokens, [20] * 30, cost_b, cost_a], [1, -1, -1, 1]
            )  # (tokens / 20 per step over plain's 1) / (1.5 cost): 2.0
            hits += lo <= 2.0 <= hi
        self.assertTrue(0.91 <= hits / 400 <= 0.99, hits / 400)

    def test_median_ratio(self):
        slower = median_ratio([1.1, 2.2, 3.3, 4.4, 5.5, 6.6], [1, 2, 3, 4, 5, 6])
        self.assertAlmostEqual(slower["median"], 1.1)
        self.assertAlmostEqual(slower["ci95"][0], 1.1)
        self.assertTrue(slower["resolvable"])
        noisy = median_ratio([0.9, 1.1, 1.0, 1.2, 0.95, 1.05], [1.0] * 6)
        self.assertEqual(noisy["ci95"], [0.9, 1.2])
        self.assertFalse(noisy["resolvable"])
        # 10 pairs: the 2nd and 9th order statistics, coverage 1 - 22/1024.
        ten = median_ratio(list(range(1, 11)), [1.0] * 10)
        self.assertEqual(ten["ci95"], [2.0, 9.0])
        self.assertAlmostEqual(ten["coverage"], 1 - 22 / 1024)
        self.assertIsNone(median_ratio([1.0] * 5, [1.0] * 5)["ci95"])  # < 6 pairs

    def test_bad_input(self):
        for fn in (mean_ratio, geometric_mean_ratio):
            with self.subTest(fn=fn.__name__):
                with self.assertRaisesRegex(ValueError, "no pairs"):
                    fn([])
                with self.assertRaisesRegex(ValueError, "> 0"):
                    fn([(1.0, 0.0)])
                # Infinite, NaN, or a ratio past float's range: refused,
                # not an inf / nan estimate or an error from statistics.
                for pair in ((1.0, math.inf), (math.inf, 1.0), (math.nan, 1.0)):
                    with self.assertRaisesRegex(ValueError, "finite"):
                        fn(PAIRS + [pair])
                for pair in ((1e-320, 1.0), (1e300, 1e-300)):  # over, under
                    with self.assertRaisesRegex(ValueError, "ratio finite"):
                        fn(PAIRS + [pair])
        # NaN ratios would sort in no order and make a "resolved" interval.
        with self.assertRaisesRegex(ValueError, "finite"):
            median_ratio([math.inf] * 3 + [2.0] * 7, [math.inf] * 3 + [1.0] * 7)
        with self.assertRaisesRegex(ValueError, "7 measurements paired with 6"):
            median_ratio([2.0] * 7, [1.0] * 6)  # zip would drop one
        for columns, powers, needle in (
            ([[1.0]], [1, -1], "1 columns for 2 powers"),
            ([[1.0], [1.0]], [1, 2], "powers must be 1 or -1"),
            ([[1.0], [1.0, 2.0]], [1, -1], "of one length"),
            ([[], []], [1, -1], "non-empty"),
            ([[1.0], [math.nan]], [1, -1], "finite and >= 0"),
            ([[1.0], [0.0]], [1, -1], "mean must be > 0"),
        ):
            with (
                self.subTest(needle=needle),
                self.assertRaisesRegex(ValueError, needle),
            ):
                mean_product(columns, powers)


if __name__ == "__main__":
    unittest.main()
