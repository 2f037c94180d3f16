"""The verify budget: the host planner (calibrated confidence, a measured
cost table, the tier that maximises expected tokens per second), the
device schedule (ScheduleVerifyLensTopk) and the ragged verify it lays
out; budget 0 is a plain decode step, and every budget keeps greedy
output equal to plain decoding."""

import copy
import itertools
import json
import os
import tempfile
import time
import unittest
from unittest import mock

import torch

from sglang import Engine
from sglang.srt.managers.schedule_batch import Req, SamplingParams
from sglang.srt.speculative.dspark_components import (
    dspark_cost_table as cost_table_module,
)
from sglang.srt.speculative.dspark_components.dspark_cost_table import (
    VerifyCostTable,
    measure_cost_table,
)
from sglang.srt.speculative.dspark_components.dspark_planner import (
    DSparkScheduleConfig,
    DSparkVerifyPlanner,
    ScheduleVerifyLensTopk,
    ragged_verify_layout,
)
from sglang.srt.utils.op_counter import OpCounter
from sglang.srt.utils.phases import PhaseRecorder
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase, umask

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

PROMPTS = [list(b"import os\n"), list(b"def main(argv):\n"), list(b"x = [1, 2, 3]\n")]


def _table(plain=1.0, per_draft=0.1, gamma=2, sizes=(1, 2, 4)):
    """Seconds: a plain step, plus per_draft per drafted token verified."""
    rows = tuple(
        tuple(plain * bs + per_draft * bs * L for L in range(gamma + 1)) for bs in sizes
    )
    return VerifyCostTable(batch_sizes=tuple(sizes), gamma=gamma, seconds=rows)


class TestScheduleVerifyLensTopk(CustomTestCase):
    def _lens(self, confidence, budget, real=None):
        g, bs = confidence.shape
        lens = torch.zeros(bs, dtype=torch.int64)
        padding = {}
        if real is not None:
            padding = dict(
                real_requests=torch.tensor(real),
                requests_1=torch.arange(1, bs + 1),
                padded=torch.zeros(bs, dtype=torch.bool),
            )
        return ScheduleVerifyLensTopk.execute(
            confidence=confidence,
            budget=budget,
            verify_lens=lens,
            gains=torch.zeros(g, bs),
            top_values=torch.zeros(budget),
            top_index=torch.zeros(budget, dtype=torch.int64),
            ones=torch.ones(budget, dtype=torch.int64),
            **padding,
        ).tolist()

    def test_maximises_the_expected_gain(self):
        # Hand-worked: request 0 is sure of 2 drafts then unsure, request 1
        # unsure from the start, request 2 fairly sure throughout.
        conf = torch.tensor(
            [[0.95, 0.3, 0.8], [0.9, 0.9, 0.8], [0.2, 0.9, 0.8]]
        )  # [gamma=3, bs=3]
        # Gains (running products): r0 .95 .855 .171; r1 .3 .27 .243;
        # r2 .8 .64 .512. The best 4: .95 .855 .8 .64 -> lens [2, 0, 2].
        self.assertEqual(self._lens(conf, 4), [2, 0, 2])
        # Against every length vector with that budget: none gains more.
        for budget in range(1, 9):
            lens = self._lens(conf, budget)
            self.assertEqual(sum(lens), budget)
            best = max(
                _gain(conf, cand)
                for cand in itertools.product(range(4), repeat=3)
                if sum(cand) == budget
            )
            self.assertAlmostEqual(_gain(conf, lens), best, places=6)

    def test_confident_draft_gets_its_whole_block(self):
        conf = torch.tensor([[0.99, 0.1], [0.99, 0.1], [0.98, 0.1]])
        self.assertEqual(self._lens(conf, 3), [3, 0])

    def test_padded_requests_take_only_what_the_real_ones_leave(self):
        # Request 2 pads a bucket of 3 (2 real); its (dummy) drafts are the
        # surest, yet it verifies nothing until the real blocks are whole.
        conf = torch.tensor([[0.5, 0.2, 0.99], [0.5, 0.2, 0.99]])
        for budget, want in ((1, [1, 0, 0]), (3, [2, 1, 0]), (5, [2, 2, 1])):
            with self.subTest(budget=budget):
                self.assertEqual(self._lens(conf, budget, real=2), want)
        # All real: the confidence alone decides.
        self.assertEqual(self._lens(conf, 3, real=3), [1, 0, 2])


def _gain(conf, lens):
    return sum(
        float(torch.prod(conf[: k + 1, b]))
        for b, n in enumerate(lens)
        for k in range(n)
    )


class TestRaggedLayout(CustomTestCase):
    def test_rows_are_each_requests_anchor_and_first_drafts(self):
        lens = torch.tensor([2, 0, 5, 1])
        t, width = 4 + 8, 6
        out = torch.zeros(t, dtype=torch.int64)
        ragged_verify_layout(
            verify_lens=lens,
            width=width,
            row_ids=torch.arange(t),
            requests_1=torch.arange(1, 5),
            row_ends=torch.zeros(4, dtype=torch.int64),
            row_req=torch.zeros(t, dtype=torch.int64),
            query_index=out,
        )
        want = [
            b * width + j for b, n in enumerate(lens.tolist()) for j in range(n + 1)
        ]
        self.assertEqual(out.tolist(), want)


class TestCostTable(CustomTestCase):
    def test_interpolates_in_budget_and_batch_size(self):
        table = _table(sizes=(1, 4))
        self.assertAlmostEqual(table.cost(bs=1, budget=0), 1.0)
        self.assertAlmostEqual(table.cost(bs=4, budget=8), 4.0 + 0.8)
        self.assertAlmostEqual(table.cost(bs=4, budget=6), 4.0 + 0.6)  # L = 1.5
        self.assertAlmostEqual(table.cost(bs=2, budget=2), 2.0 + 0.2)  # between sizes
        self.assertAlmostEqual(table.cost(bs=8, budget=0), 8.0)  # past the last
        with self.assertRaisesRegex(ValueError, "outside"):
            table.cost(bs=2, budget=5)

    def test_past_the_largest_size_a_step_costs_its_per_request(self):
        # A larger size measured a little cheaper than a smaller one must not
        # extrapolate to a free (or negative) step.
        table = VerifyCostTable(
            batch_sizes=(1, 2), gamma=1, seconds=((1.0, 1.1), (0.9, 1.0))
        )
        self.assertAlmostEqual(table.cost(bs=20, budget=0), 0.9 * 10)
        self.assertAlmostEqual(table.cost(bs=20, budget=20), 1.0 * 10)

    def test_save_load_and_bad_files(self):
        table = _table()
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "table.json")
            table.save(path)
            self.assertEqual(VerifyCostTable.load(path), table)
            # A save cut short leaves the table saved before, and nothing else.
            other = _table(per_draft=0.5)
            with mock.patch.object(
                cost_table_module.json, "dump", side_effect=KeyboardInterrupt
            ):
                with self.assertRaises(KeyboardInterrupt):
                    other.save(path)
            self.assertEqual(VerifyCostTable.load(path), table)
            self.assertEqual(os.listdir(d), ["table.json"])
            for mask in (0o022, 0o077, 0o002):  # as a plain open makes it
                with umask(mask):
                    other.save(path)
                self.assertEqual(os.stat(path).st_mode & 0o777, 0o666 & ~mask)
            self.assertEqual(VerifyCostTable.load(path), other)
            with open(path, "w") as f:
                f.write("{")
            with self.assertRaisesRegex(ValueError, "unreadable"):
                VerifyCostTable.load(path)
            # Hand edits that loaded as another table, or escaped the error.
            good = {"batch_sizes": [1, 2], "gamma": 1, "seconds": [[1, 2], [2, 3]]}
            for field, value in (
                ("seconds", ["12", "12"]),  # read as the digits 1, 2
                ("batch_sizes", "12"),
                ("gamma", 1.9),  # read as 1
                ("gamma", True),
                ("batch_sizes", [1.7, 2.2]),
                ("gamma", "1e400"),  # 1e400 below, unquoted: an OverflowError
                ("measured_for", 7),
                ("seconds", [[1, 10**401], [2, 3]]),  # float() overflows
            ):
                with self.subTest(field=field, value=value):
                    text = json.dumps(dict(good, **{field: value}))
                    with open(path, "w") as f:
                        f.write(text.replace('"1e400"', "1e400"))
                    with self.assertRaisesRegex(ValueError, "unreadable"):
                        VerifyCostTable.load(path)
            with open(path, "w") as f:
                json.dump(good, f)
            self.assertEqual(VerifyCostTable.load(path).seconds, ((1, 2), (2, 3)))
        for bad in (0.0, float("nan"), float("inf"), 10**400):  # past float
            with self.assertRaisesRegex(ValueError, "positive finite"):
                VerifyCostTable(batch_sizes=(1,), gamma=1, seconds=((1.0, bad),))

    def test_measured_over_every_size_and_budget(self):
        calls = []
        table = measure_cost_table(
            run_step=lambda bs, budget: calls.append((bs, budget)),
            batch_sizes=[1, 2],
            gamma=2,
            repeats=3,
        )
        self.assertEqual(table.batch_sizes, (1, 2))
        expected = {(bs, bs * L) for bs in (1, 2) for L in range(3)}
        self.assertEqual(set(calls), expected)
        self.assertEqual(len(calls), (2 + 3) * 6)  # two warm-ups, three timed
        self.assertTrue(all(t > 0 for row in table.seconds for t in row))
        self.assertIn("bs 2", table.format())


class TestPlanner(CustomTestCase):
    def _planner(self, table, **kw):
        return DSparkVerifyPlanner(gamma=2, cost_table=table, replan_every=1, **kw)

    def _know(self, planner, bin_rates):
        """Calibration as if many drafts were seen: greedy bin -> rate."""
        for b, rate in bin_rates.items():
            planner.seen[0][b], planner.accepted[0][b] = 1e9, rate * 1e9

    def test_picks_the_tier_with_the_most_tokens_per_second(self):
        # bs 2, gamma 2; calibrated acceptance .9 (bin 9) and .5 (bin 5).
        # Gains: r0 .9 .81, r1 .5 .25 -> expected by budget 0: 2, 2: 3.71,
        # 4: 4.46. Costs (plain 1, 0.4 a draft): 2.0, 2.8, 3.6 -> rates 1.0,
        # 1.325, 1.239: budget 2.
        planner = self._planner(_table(per_draft=0.4))
        self._know(planner, {9: 0.9, 5: 0.5})
        conf = [[0.95, 0.95], [0.55, 0.55]]
        self.assertEqual(planner.plan(confidence=conf, sampled=[False, False]), 2)
        # A confident pair gets every draft verified.
        self._know(planner, {9: 0.99})
        sure = [[0.95, 0.95]] * 2
        self.assertEqual(planner.plan(confidence=sure, sampled=[False, False]), 4)
        # Drafts that cost more than they win: a plain step.
        costly = self._planner(_table(per_draft=2.0))
        self._know(costly, {5: 0.5})
        low = [[0.55, 0.55]] * 2
        self.assertEqual(costly.plan(confidence=low, sampled=[False, False]), 0)

    def test_blind_requests_are_credited_their_equal_shares(self):
        # Sampled rows calibrated .95 and .10 (bins 9 and 1), plain 1 and .6
        # a draft. Scheduled by confidence (seeded), L = 1 verifies r0's two
        # drafts: 2 + .95 + .9025 = 3.85 tokens for 3.2, 1.20 a plain step's
        # rate: budget 2. Blind (unseeded), the device gives each request one
        # draft: 2 + .95 + .10 = 3.05 for 3.2, 0.95; L = 2, 3.9625 for 4.4,
        # 0.90: a plain step. Crediting the best gains chose budget 2, about
        # 5% slower than plain decoding.
        conf, kinds = [[0.95, 0.95], [0.15, 0.15]], [True, True]
        for blind, budget in (([False, False], 2), ([True, True], 0)):
            planner = self._planner(_table(per_draft=0.6))
            for b, rate in {9: 0.95, 1: 0.10}.items():
                planner.seen[1][b], planner.accepted[1][b] = 1e9, rate * 1e9
            with self.subTest(blind=blind):
                self.assertEqual(
                    planner.plan(confidence=conf, sampled=kinds, blind=blind), budget
                )

    def test_blind_ties_are_credited_whatever_the_order(self):
        # A greedy request and two blind ones: the blind drafts at one
        # position tie on the device's key and are picked in no set order.
        # Crediting the tied drafts of the first request listed made the
        # plan depend on the order (3 against 0).
        conf = [[0.95, 0.95], [0.95, 0.95], [0.15, 0.15]]
        plans = []
        for order in ([0, 1, 2], [0, 2, 1]):
            planner = self._planner(_table(per_draft=0.6))
            self._know(planner, {9: 0.95})
            for b, rate in {9: 0.95, 1: 0.10}.items():
                planner.seen[1][b], planner.accepted[1][b] = 1e9, rate * 1e9
            plans.append(
                planner.plan(
                    confidence=[conf[i] for i in order],
                    sampled=[i > 0 for i in order],
                    blind=[i > 0 for i in order],
                )
            )
        self.assertEqual(plans[0], plans[1])

    def test_near_ties_take_the_larger_budget(self):
        # Rates within TIE of the best: verify more (the same throughput,
        # more tokens a step).
        planner = self._planner(_table(per_draft=0.5))
        self._know(planner, {9: 0.95})
        # Gains .95 .9025 per request: rates 1.0, 2.95/1.5, 3.85/2 -> 1.0,
        # 1.967, 1.926 (within 2%): budget 2 per request.
        conf = [[0.95, 0.95]]
        self.assertEqual(planner.plan(confidence=conf, sampled=[False]), 2)

    def test_a_padded_bucket_credits_the_drafts_it_verifies(self):
        # 2 requests, gains .9 .81 each, costs 2, 2.2, 2.4 for L = 0..2:
        # unpadded L = 2 (5.42 / 2.4 against 3.8 / 2.2); in a bucket of 4,
        # L = 1 verifies 4 drafts, both blocks whole: 5.42 / 2.2.
        planner = self._planner(_table())
        conf, kinds = [None, None], [False, False]
        self.assertEqual(planner.plan(confidence=conf, sampled=kinds), 4)
        self.assertEqual(planner.plan(confidence=conf, sampled=kinds, rows=4), 2)

    def test_new_requests_take_the_position_prior(self):
        planner = self._planner(_table(per_draft=0.4))
        self.assertEqual(planner.position_rate, [0.9, 0.9])  # optimistic
        self.assertEqual(planner.plan(confidence=[None], sampled=[True]), 2)

    def test_streaks_of_one_kind_explore_the_other(self):
        # Plain streaks draft once, drafting streaks step plain once: else
        # the other kind's cost and acceptance would never be measured again.
        for per_draft, b, rate, plans in (
            (2.0, 5, 0.5, [0, 0, 0, 2, 0, 0, 0, 2]),
            (0.01, 9, 0.95, [4, 4, 4, 0, 4, 4, 4, 0]),
        ):
            with self.subTest(plans=plans):
                planner = self._planner(_table(per_draft=per_draft), explore_every=4)
                self._know(planner, {b: rate})
                conf = [[rate, rate]] * 2
                got = [
                    planner.plan(confidence=conf, sampled=[False] * 2) for _ in range(8)
                ]
                self.assertEqual(got, plans)

    def test_one_stalled_step_moves_its_scale_a_tenth_at_most(self):
        planner = self._planner(_table())
        planner.observe_cost(bs=2, budget=0, seconds=100 * 2.0)  # a 100x stall
        self.assertAlmostEqual(planner.step_cost(bs=2, budget=0), 2.0 * 1.1)
        planner.observe_cost(bs=2, budget=0, seconds=0.0)  # and down: by 5%
        self.assertAlmostEqual(planner.step_cost(bs=2, budget=0), 2.0 * 1.1 * 0.95)

    def test_the_calibration_follows_a_change(self):
        # 100% accepted for a long while, then nothing: the bin forgets.
        planner = self._planner(_table())
        planner.seen[0][9] = planner.accepted[0][9] = 1e4
        for _ in range(5000):
            planner.observe(
                confidence=[[0.95, 0.95]],
                sampled=[False],
                accept_lens=[0],
                verify_lens=[2],
            )
        self.assertLess(planner.calibrate(0.95, False, 0), 0.1)

    def test_a_broken_drafts_confidence_counts_as_zero(self):
        planner = self._planner(_table())
        nan, inf = float("nan"), float("inf")
        planner.observe(
            confidence=[[nan, inf]], sampled=[True], accept_lens=[1], verify_lens=[2]
        )
        self.assertEqual(planner.seen[1][0], 2.0)  # both in bin 0
        self.assertIn(planner.plan(confidence=[[nan, inf]], sampled=[True]), (0, 1, 2))

    def test_a_plan_holds_for_replan_every_steps(self):
        planner = DSparkVerifyPlanner(gamma=2, cost_table=_table(), replan_every=3)
        budgets, wants = [], []
        for step in range(6):
            budget = planner.held(2)
            if budget is None:
                budget = planner.plan(confidence=[None, None], sampled=[False] * 2)
            budgets.append(budget)
            wants.append(planner.wants_confidence)
        # A plan every third step; the step before each plan reports.
        self.assertEqual(wants, [False, False, True, False, False, True])
        self.assertEqual(len(set(budgets)), 1)
        self.assertIsNone(planner.held(3))  # another batch size plans anew

    def _step(self, planner, bs, conf):
        """One step as the worker takes it: the held budget, or a new plan."""
        budget = planner.held(bs)
        if budget is None:
            budget = planner.plan(confidence=conf[:bs], sampled=[False] * bs)
        return budget

    def test_a_batch_that_changes_size_every_step_is_still_observed(self):
        # Requests join and leave every step: each step plans anew, so no
        # plan runs out; every replan_every-th step reports all the same,
        # and drafts that are never accepted turn the plans plain.
        planner = DSparkVerifyPlanner(gamma=2, cost_table=_table(), replan_every=4)
        wants, budgets, conf = [], [], [[0.95, 0.95]] * 3
        for step in range(400):
            bs = 2 + step % 2
            budget = self._step(planner, bs, conf)
            wants.append(planner.wants_confidence)
            budgets.append(budget // bs)
            if budget and planner.wants_confidence:  # every draft rejected
                planner.observe(
                    confidence=conf[:bs],
                    sampled=[False] * bs,
                    accept_lens=[0] * bs,
                    verify_lens=[budget // bs] * bs,
                )
        self.assertEqual(wants[:8], [False, False, False, True] * 2)
        self.assertEqual(budgets[:4], [2, 2, 2, 2])  # the optimistic prior
        late = budgets[-96:]  # plain, but for an exploring step in 33
        self.assertLessEqual(sum(1 for L in late if L), 3)

    def test_an_exploring_drafting_step_holds_for_one_step(self):
        # Plain plans (drafts cost more than they win) explore one drafting
        # step after explore_every of them, not a whole replan_every hold.
        planner = DSparkVerifyPlanner(
            gamma=2, cost_table=_table(per_draft=2.0), replan_every=4, explore_every=4
        )
        self._know(planner, {5: 0.5})
        conf = [[0.55, 0.55]] * 2
        got = [self._step(planner, 2, conf) for _ in range(10)]
        self.assertEqual(got, [0, 0, 0, 2, 0, 0, 0, 2, 0, 0])

    def test_ranks_holding_an_agreed_budget_replan_together(self):
        # EP ranks each plan (one plain, one drafting) and hold the largest:
        # from then on they hold and plan again on the same steps.
        ranks = [
            DSparkVerifyPlanner(gamma=2, cost_table=_table(per_draft=d), replan_every=3)
            for d in (50.0, 0.01)
        ]
        plans = [p.plan(confidence=[None] * 2, sampled=[False] * 2) for p in ranks]
        self.assertEqual(plans[0], 0)
        self.assertGreater(plans[1], 0)
        for p in ranks:
            p.hold(max(plans))
        steps = [
            [(p.held(2), p.wants_confidence) for _ in range(2 * p.replan_every)]
            for p in ranks
        ]
        self.assertEqual(steps[0], steps[1])
        self.assertEqual(steps[0][0], (max(plans), False))

    def test_observed_acceptance_calibrates_the_confidence(self):
        planner = self._planner(_table(), prior_weight=4.0)
        # Row 0 verified only draft 0 (accepted; its draft 1 not judged);
        # row 1 accepted draft 0 and rejected draft 1.
        planner.observe(
            confidence=[[0.95, 0.95], [0.95, 0.15]],
            sampled=[False, False],
            accept_lens=[1, 1],
            verify_lens=[1, 2],
        )
        table = {(r["kind"], r["bin"][0]): r for r in planner.calibration_table()}
        self.assertEqual(table[("greedy", 0.9)]["drafts"], 2)
        self.assertEqual(table[("greedy", 0.9)]["observed"], 1.0)
        self.assertAlmostEqual(table[("greedy", 0.9)]["predicted"], 0.95)
        self.assertEqual(table[("greedy", 0.1)]["drafts"], 1)
        self.assertEqual(table[("greedy", 0.1)]["observed"], 0.0)
        self.assertNotIn(("sampled", 0.1), table)
        # Position 1: judged once, rejected: its rate moves from 0.9 to 0.81.
        self.assertAlmostEqual(planner.position_rate[1], 0.9 + 0.1 * (0.0 - 0.9))
        # calibrated = (accepted + w prior) / (seen + w), prior the position's
        got = planner.calibrate(0.15, False, 1)
        self.assertAlmostEqual(got, (0 + 4 * planner.position_rate[1]) / (1 + 4))

    def test_observed_step_costs_scale_the_table(self):
        planner = self._planner(_table())
        self.assertAlmostEqual(planner.step_cost(bs=2, budget=2), 2.2)
        for _ in range(200):  # a running mean: 0.9 ** 200 of the start is left
            planner.observe_cost(bs=2, budget=2, seconds=4.4)
        self.assertAlmostEqual(planner.step_cost(bs=2, budget=4), 2 * 2.4, places=3)
        self.assertAlmostEqual(planner.step_cost(bs=2, budget=0), 2.0)  # apart

    def test_reset_forgets_what_steps_taught_it(self):
        table = _table()
        fresh, planner = self._planner(table), self._planner(table)
        self._know(planner, {9: 0.2})
        planner.observe(
            confidence=[[0.95, 0.15]], sampled=[True], accept_lens=[1], verify_lens=[2]
        )
        planner.observe_cost(bs=2, budget=2, seconds=9.0)
        planner.plan(confidence=[[0.95, 0.15], None], sampled=[False, True])
        self.assertNotEqual(vars(planner), vars(fresh))
        planner.reset()
        self.assertEqual(vars(planner), vars(fresh))
        self.assertIs(planner.cost_table, table)

    def test_schedule_config(self):
        self.assertEqual(DSparkScheduleConfig().min_verify_len, 1)
        with self.assertRaisesRegex(ValueError, "min_verify_len"):
            DSparkScheduleConfig(min_verify_len=-1)


def _engine(budget, algorithm="DSPARK", **kw):
    args = dict(device="cpu", random_seed=0, max_running_requests=4, **kw)
    if algorithm:
        args.update(speculative_algorithm=algorithm, speculative_verify_budget=budget)
    return Engine(**args)


def _steps_with_all_prompts(engine, params):
    """Submit PROMPTS (``params[i]`` for prompt i), prefill them, then yield
    after each decode step that ran all three."""
    sched = engine.scheduler
    for i, (ids, p) in enumerate(zip(PROMPTS, params)):
        sched.add_request(Req(rid=i, origin_input_ids=ids, sampling_params=p))
    sched.step()  # the prefills
    while sched.has_work():
        sched.step()
        if sched._batch is not None and sched._batch.batch_size == len(PROMPTS):
            yield


class TestBudgetsEndToEnd(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.params = {"max_new_tokens": 24}
        plain = _engine(None, algorithm=None)
        outs = plain.generate(input_ids=PROMPTS, sampling_params=cls.params)
        cls.plain = [o["output_ids"] for o in outs]

    def test_every_budget_keeps_greedy_equal_to_plain(self):
        for budget, buckets in itertools.product(
            ("auto", "off", 0, 1, 4, 100), (None, [1, 2, 4])
        ):
            with self.subTest(budget=budget, buckets=buckets):
                engine = _engine(budget, cuda_graph_bs=buckets)
                outs = engine.generate(input_ids=PROMPTS, sampling_params=self.params)
                self.assertEqual([o["output_ids"] for o in outs], self.plain)
                verify = [o["meta_info"]["spec_verify_tokens"] for o in outs]
                if budget == 0:
                    self.assertEqual(verify, [0.0] * 3)
                if budget == "off":
                    self.assertEqual(verify, [5.0] * 3)

    def test_budget_zero_is_a_plain_step(self):
        # No draft forward, the plain forward's ops, and the draft context
        # written when drafting resumes (the stash), not every step.
        dspark, plain = _engine(0), _engine(None, algorithm=None)
        counts, reqs = {}, {}
        for name, engine in (("dspark", dspark), ("plain", plain)):
            sched = engine.scheduler
            params = SamplingParams(max_new_tokens=8)
            req = reqs[name] = Req(
                rid=99, origin_input_ids=PROMPTS[0], sampling_params=params
            )
            sched.add_request(req)
            sched.step()
            with OpCounter() as c:
                engine.worker.spans.hook = rec = PhaseRecorder(counter=c)
                sched.step()
            engine.worker.spans.hook = None
            counts[name] = (c.ops, rec.totals)
            while sched.has_work():
                sched.step()
        ops, spans = counts["dspark"]
        self.assertNotIn("draft forward", spans)
        self.assertNotIn("context write", spans)
        plain_forward = counts["plain"][1]["forward"]["ops"]
        # The same model on the same rows; its hidden states are captured.
        self.assertLessEqual(spans["verify forward"]["ops"] - plain_forward, 2)
        self.assertLess(ops, counts["plain"][0] + 20)
        # Its draft context waits in the stash, from the first plain step's anchor.
        self.assertEqual(reqs["dspark"].draft_context_from, len(PROMPTS[0]))

    def test_stashed_context_is_written_when_drafting_resumes(self):
        # Plain steps, then drafting: the draft's context KV equals that of
        # an engine that drafted throughout (its context write every step).
        # A stash write that fails is redone by the next step ("retried").
        runs = {}
        for name, budget in (("resumed", 0), ("retried", 0), ("always", "off")):
            engine = _engine(budget)
            sched = engine.scheduler
            req = _one_request(engine, max_new_tokens=40)
            while len(req.output_ids) < 12:
                sched.step()
            if name != "always":
                self.assertIsNotNone(req.draft_context_from)
                engine.worker.verify_budget = "off"  # draft from now on
                if name == "retried":
                    draft = engine.worker.draft_model
                    with mock.patch.object(
                        draft, "write_context", side_effect=RuntimeError("write")
                    ):
                        with self.assertRaisesRegex(RuntimeError, "write"):
                            sched.step()
                    self.assertIsNotNone(req.draft_context_from)  # still owed
                sched.step()
                self.assertIsNone(req.draft_context_from)
            pool = engine.worker.draft_runner.token_to_kv_pool
            slots = req.kv_slots[: len(req.origin_input_ids) + 10]
            runs[name] = pool.k[:, slots].clone()
        for name in ("resumed", "retried"):
            torch.testing.assert_close(runs[name], runs["always"], rtol=1e-4, atol=1e-5)

    def test_the_step_resuming_drafting_is_timed_without_the_stash_write(self):
        # It also writes the context stashed by the plain steps before it:
        # timed with it, it skewed the drafting scale up after every plain
        # streak (whose only drafting steps are such).
        engine = _engine("auto")
        worker, sched = engine.worker, engine.scheduler
        planner = worker.planner
        req = _one_request(engine, max_new_tokens=60)
        sched.step()  # admission and prefill, one decode step

        def hold(budget):  # the plan held for the next steps
            planner._last, planner._countdown = (1, budget), 100

        write = worker._write_stashed_context

        def slow_write(batch):  # a stash write that takes 0.3 s
            time.sleep(0.3)
            return write(batch)

        observed = []
        with (
            mock.patch.object(
                planner,
                "observe_cost",
                side_effect=lambda **kw: observed.append((kw["budget"], kw["seconds"])),
            ),
            mock.patch.object(worker, "_write_stashed_context", side_effect=slow_write),
        ):
            hold(0)
            for _ in range(3):
                sched.step()
            self.assertIsNotNone(req.draft_context_from)  # owed
            hold(worker.gamma)
            began = time.perf_counter()
            sched.step()  # writes the stashed context, then drafts
            took = time.perf_counter() - began
            self.assertIsNone(req.draft_context_from)
            sched.step()
        self.assertEqual(
            [b for b, _ in observed], [0, 0, 0, worker.gamma, worker.gamma]
        )
        self.assertGreater(took, 0.3)
        self.assertLess(observed[3][1], 0.3)  # the step less its stash write


def _one_request(engine, *, max_new_tokens: int) -> Req:
    """PROMPTS[1] queued on ``engine``'s scheduler."""
    req = Req(
        rid=0,
        origin_input_ids=PROMPTS[1],
        sampling_params=SamplingParams(max_new_tokens=max_new_tokens),
    )
    engine.scheduler.add_request(req)
    return req


def _learned(planner) -> dict:
    """A copy of what a planner holds besides its cost table."""
    return copy.deepcopy({k: v for k, v in vars(planner).items() if k != "cost_table"})


class TestFlushCache(CustomTestCase):
    def test_an_idle_engine_forgets_what_its_steps_taught_it(self):
        engine = _engine("auto")
        planner, sched = engine.worker.planner, engine.scheduler
        fresh, table = _learned(planner), planner.cost_table
        during = []  # per step inside generate(): (flushed, scheduler had work)

        def progress(_tokens):
            had_work = sched.has_work()
            during.append((engine.flush_cache(), had_work))

        params = {"max_new_tokens": 24, "temperature": 1.0}
        engine.generate(input_ids=PROMPTS, sampling_params=params, progress=progress)
        # Refused at every step; after the last one the scheduler had no work
        # left: the call running is what refuses it there.
        self.assertEqual({flushed for flushed, _ in during}, {False})
        self.assertEqual(during[-1], (False, False))
        self.assertNotEqual(_learned(planner), fresh)
        self.assertGreater(sched.running_accept_length, 0.0)
        sched._warned_draft = True  # as after a draft-health warning
        self.assertTrue(engine.flush_cache())
        self.assertEqual(_learned(planner), fresh)
        self.assertIs(planner.cost_table, table)  # measured once, kept
        self.assertFalse(sched._warned_draft)
        self.assertEqual(sched.running_accept_length, 0.0)
        # Still serves, and plain engines flush too (nothing to forget).
        outs = engine.generate(
            input_ids=PROMPTS[:1], sampling_params={"max_new_tokens": 4}
        )
        self.assertEqual(len(outs[0]["output_ids"]), 4)
        self.assertTrue(_engine(None, algorithm=None).flush_cache())

    def test_queued_requests_refuse_the_flush(self):
        engine = _engine("auto")
        engine.scheduler.add_request(
            Req(
                rid=0,
                origin_input_ids=PROMPTS[0],
                sampling_params=SamplingParams(max_new_tokens=4),
            )
        )
        self.assertFalse(engine.flush_cache())
        while engine.scheduler.has_work():
            engine.scheduler.step()
        self.assertTrue(engine.flush_cache())


class TestPaddedRaggedVerify(CustomTestCase):
    def test_real_requests_verify_first_and_the_host_knows_their_rows(self):
        # 3 requests in a bucket of 4 (gamma 5): a budget of 4 drafts goes
        # to the real requests; of 17, they verify all 15 of theirs and the
        # padding request the other 2. The verify's real rows (the int32
        # scalar EP > 1's router masks by) are 3 + 4 and 3 + 15, as the host
        # says.
        target = "sglang.srt.model_executor.forward_batch_info"
        for budget in (4, 17):
            with (
                self.subTest(budget=budget),
                mock.patch(f"{target}.enable_num_token_non_padded", return_value=True),
            ):
                self._check(budget)

    def _check(self, budget):
        engine = _engine(budget, cuda_graph_bs=[1, 2, 4])
        worker = engine.worker
        g = worker.gamma
        ragged = worker.buffers.ragged(4, budget)
        steps = 0
        params = [SamplingParams(max_new_tokens=30) for _ in PROMPTS]
        for _ in _steps_with_all_prompts(engine, params):
            steps += 1
            lens = worker.buffers.at(4).verify_lens.tolist()
            self.assertEqual(sum(lens), budget)
            self.assertEqual(lens[3], max(0, budget - 3 * g))
            real = int((ragged.row_req < 3).sum())
            self.assertEqual(real, 3 + min(budget, 3 * g))
            self.assertEqual(worker.buffers.verify_scalar.item(), real)
            self.assertEqual(ragged.batch.num_token_non_padded_cpu, real)
        self.assertGreater(steps, 0)


class TestSampledRowsShareBlind(CustomTestCase):
    def test_unseeded_sampled_rows_share_the_budget_equally(self):
        # Their drafts must not decide how many of them are judged (else the
        # output leaves the target's distribution): 4 drafts over 3 such
        # requests go 2, 1, 1 whatever the drafts' confidence. A seeded row
        # may take its share by confidence: the two unseeded ones still
        # split theirs within one draft.
        for seeds in ((None, None, None), (None, None, 7)):
            with self.subTest(seeds=seeds):
                engine = _engine(4)
                worker = engine.worker
                params = [
                    SamplingParams(
                        max_new_tokens=30, temperature=1.0, sampling_seed=seed
                    )
                    for seed in seeds
                ]
                steps = 0
                for _ in _steps_with_all_prompts(engine, params):
                    steps += 1
                    lens = worker.buffers.at(3).verify_lens.tolist()
                    self.assertEqual(sum(lens), 4)
                    if seeds[2] is None:
                        self.assertEqual(sorted(lens), [1, 1, 2])
                    else:
                        self.assertLessEqual(abs(lens[0] - lens[1]), 1)
                self.assertGreater(steps, 0)


class TestServerArgs(CustomTestCase):
    def test_bad_budgets(self):
        for bad in ("on", -1, 1.5, True):
            with self.subTest(budget=bad):
                with self.assertRaisesRegex(ValueError, "speculative_verify_budget"):
                    _engine(bad)
        with self.assertRaisesRegex(ValueError, "only used with"):
            Engine(speculative_verify_budget="off")


if __name__ == "__main__":
    unittest.main()
