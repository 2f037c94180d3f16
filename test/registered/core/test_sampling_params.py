"""The sampling parameters people serve with (upstream's names), lossless
under DSpark, and a draft that cannot fail silently.

- every parameter is validated, and accepted by ``Engine.generate`` for
  DSPARK and plain decoding, mixed in one batch;
- greedy decoding with penalties, stop ids, ``min_new_tokens``,
  ``ignore_eos`` or truncation equals plain decoding token for token (and
  each parameter visibly changes the output);
- sampled: a chi-square test of the tokens' distribution, at the acceptance
  rule (many rows, against the processed target distribution computed by
  hand, and failing when q is truncated wrongly) and end to end (DSpark's
  first decoded tokens against plain decoding's);
- ``sampling_seed``: a request's tokens depend on its prompt, parameters and
  seed alone (not its batch), and DSpark's equal plain decoding's;
- ``return_logprob``: equal between DSpark and plain decoding;
- a NaN draft is refused at load, naming the tensor; the running accepted
  length is in ``meta_info``, and a draft that is never accepted is logged.
"""

import math
import os
import shutil
import tempfile
import unittest

import torch
from safetensors.torch import load_file, save_file

from sglang import Engine
from sglang.srt.layers.sampler import (
    SamplingExtras,
    SamplingMode,
    draw_log_exp1_,
    seeded_log_e,
)
from sglang.srt.managers.schedule_batch import SamplingParams
from sglang.srt.model_loader.loader import WEIGHTS_NAME, save_checkpoint
from sglang.srt.models.registry import load_draft, load_target
from sglang.srt.speculative.dspark_components.dspark_planner import (
    ScheduleVerifyLensTopk,
    blind_gains,
)
from sglang.srt.speculative.dspark_components.dspark_verify import accept
from sglang.stdlib_corpus import load_stdlib_corpus, sample_prompts
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase, dspark_step_views

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

P_FLOOR = 1e-3  # a chi-square test passes above this p-value
EOS = 10  # "\n" in the byte vocabulary: it comes up often


def _prompts(num: int, seed: int = 1):
    return sample_prompts(
        load_stdlib_corpus().read("heldout"), num=num, length=32, seed=seed
    )


def _chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat), X ~ chi-square(dof): the upper regularized gamma."""
    return float(
        torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0))
    )


def _chi2_goodness(counts: torch.Tensor, p: torch.Tensor, min_expected=5.0) -> float:
    """p-value of ``counts`` against probabilities ``p`` (cells expecting
    fewer than ``min_expected`` pooled into one)."""
    n = counts.sum().item()
    expected = p.double() * n
    big = expected >= min_expected
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum().item()
    return _chi2_sf(stat, int(keep.sum()) - 1)


def _chi2_two_sample(a: dict, b: dict, min_count=10) -> float:
    """p-value that two samples of categories come from one distribution
    (categories seen fewer than ``min_count`` times in all pooled)."""
    cats = sorted(set(a) | set(b))
    big = [c for c in cats if a.get(c, 0) + b.get(c, 0) >= min_count]
    rows = [[a.get(c, 0) for c in big], [b.get(c, 0) for c in big]]
    rows[0].append(sum(a.get(c, 0) for c in cats if c not in big))
    rows[1].append(sum(b.get(c, 0) for c in cats if c not in big))
    table = torch.tensor(rows, dtype=torch.float64)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum().item()
    return _chi2_sf(stat, table.shape[1] - 1)


class TestValidation(CustomTestCase):
    def test_each_bad_value_names_the_parameter(self):
        cases = [
            ({"top_p": 0}, "top_p must be a finite number in \\(0, 1\\]"),
            ({"top_p": 1.5}, "top_p"),
            ({"top_k": 0}, "top_k must be -1 \\(all tokens\\) or an int >= 1"),
            ({"top_k": 2.0}, "top_k"),
            ({"min_p": -0.1}, "min_p must be a finite number in \\[0, 1\\]"),
            ({"repetition_penalty": 0}, "repetition_penalty .* in \\[1e-06, 2\\]"),
            ({"repetition_penalty": 1e-50}, "repetition_penalty .* got 1e-50"),
            ({"temperature": 1e39}, "temperature .* in \\[0, 1e\\+30\\]"),
            ({"frequency_penalty": 2.5}, "frequency_penalty .* in \\[-2, 2\\]"),
            ({"presence_penalty": float("nan")}, "presence_penalty"),
            ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids"),
            ({"stop_token_ids": [1, -1]}, "stop_token_ids must be an int >= 0"),
            ({"ignore_eos": 1}, "ignore_eos must be a bool"),
            ({"min_new_tokens": 20}, "min_new_tokens must be an int in \\[0, max_new"),
            (
                {"sampling_seed": -1},
                "sampling_seed must be an int in \\[0, 2\\*\\*63\\)",
            ),
            ({"sampling_seed": True}, "sampling_seed"),
        ]
        for kwargs, needle in cases:
            with self.subTest(**{k: repr(v) for k, v in kwargs.items()}):
                with self.assertRaisesRegex(ValueError, needle):
                    SamplingParams(**kwargs)

    def test_every_parameter_accepted_mixed_in_one_batch(self):
        every = dict(
            temperature=0.8,
            top_p=0.9,
            top_k=20,
            min_p=0.02,
            repetition_penalty=1.1,
            frequency_penalty=0.2,
            presence_penalty=0.1,
            stop_token_ids=[EOS],
            ignore_eos=True,
            min_new_tokens=2,
            sampling_seed=5,
            max_new_tokens=8,
        )
        params = [every, {"max_new_tokens": 8}, dict(every, temperature=0)]
        for algo in (None, "DSPARK"):
            with self.subTest(algorithm=algo):
                engine = Engine(
                    speculative_algorithm=algo, device="cpu", eos_token_id=EOS
                )
                out = engine.generate(
                    input_ids=_prompts(3),
                    sampling_params=params,
                    return_logprob=[True, False, True],
                )
                self.assertEqual(len(out), 3)
                self.assertEqual(
                    len(out[0]["meta_info"]["output_token_logprobs"]),
                    len(out[0]["output_ids"]),
                )
                self.assertNotIn("output_token_logprobs", out[1]["meta_info"])
                engine.scheduler.check_pool_accounting()

    def test_a_top_k_past_float32_keeps_every_token(self):
        # 10**400 overflowed the float32 parameter row mid-step (under DP
        # attention that put the ranks' collectives out of step for good).
        seeded = dict(temperature=1.0, sampling_seed=7, max_new_tokens=8)
        for algo in (None, "DSPARK"):
            with self.subTest(algorithm=algo):
                engine = Engine(speculative_algorithm=algo, device="cpu")
                out = [
                    engine.generate(
                        input_ids=_prompts(2),
                        sampling_params=[{"max_new_tokens": 4}, dict(seeded, top_k=k)],
                    )[1]["output_ids"]
                    for k in (10**400, 2**31, -1)
                ]
                self.assertEqual(out[0], out[2])
                self.assertEqual(out[1], out[2])
                engine.scheduler.check_pool_accounting()

    def test_stop_ids_outside_the_vocabulary(self):
        engine = Engine(device="cpu")
        with self.assertRaisesRegex(ValueError, "input 0: .*stop_token_ids \\[999\\]"):
            engine.generate(
                input_ids=[[1, 2]], sampling_params={"stop_token_ids": [999]}
            )
        with self.assertRaisesRegex(ValueError, "return_logprob must be"):
            engine.generate(input_ids=[[1, 2]], return_logprob="yes")

    def test_min_new_tokens_that_would_mask_every_token(self):
        # Stop ids and EOS over the whole vocabulary: min_new_tokens would
        # leave nothing to sample. Refused; one id fewer (or min_new_tokens
        # 0, or EOS ignored with it the missing id) runs.
        engine = Engine(device="cpu", eos_token_id=EOS)
        vocab = engine.scheduler.vocab_size
        others = [t for t in range(vocab) if t != EOS]
        with self.assertRaisesRegex(
            ValueError, "input 0: .*min_new_tokens 2 masks every token"
        ):
            engine.generate(
                input_ids=[[1, 2]],
                sampling_params={"stop_token_ids": others, "min_new_tokens": 2},
            )
        engine.scheduler.check_pool_accounting()
        for params in (
            {"stop_token_ids": others[1:], "min_new_tokens": 2},
            {"stop_token_ids": others, "min_new_tokens": 0},
            {"stop_token_ids": others, "min_new_tokens": 2, "ignore_eos": True},
        ):
            with self.subTest(
                **{k: v for k, v in params.items() if k != "stop_token_ids"}
            ):
                out = engine.generate(
                    input_ids=[[1, 2]], sampling_params=dict(params, max_new_tokens=3)
                )
                self.assertGreater(len(out[0]["output_ids"]), 0)


class TestGreedyEqualsPlain(CustomTestCase):
    """Deterministic parameters: DSpark's output is plain decoding's."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.prompts = _prompts(6)
        args = dict(device="cpu", max_running_requests=4, eos_token_id=EOS)
        cls.plain = Engine(**args)
        cls.spark = Engine(speculative_algorithm="DSPARK", **args)
        cls.base = cls._both({"max_new_tokens": 24, "ignore_eos": True})[0]

    @classmethod
    def _both(cls, params):
        out = []
        for engine in (cls.plain, cls.spark):
            res = engine.generate(input_ids=cls.prompts, sampling_params=params)
            out.append([r["output_ids"] for r in res])
        return out

    def _check(self, params):
        plain, spark = self._both(dict(max_new_tokens=24, **params))
        self.assertEqual(spark, plain)
        return plain

    def test_penalties(self):
        for params in (
            {"repetition_penalty": 1.4, "ignore_eos": True},
            {"frequency_penalty": 1.0, "ignore_eos": True},
            {"presence_penalty": 1.5, "ignore_eos": True},
        ):
            with self.subTest(**params):
                out = self._check(params)
                self.assertNotEqual(out, self.base)  # it changed the output

    def test_a_temperature_below_the_eps_is_greedy(self):
        # Upstream's rule: below 1e-6 a request samples greedily (1e-39
        # would overflow 1 / T in float32; 1e-320 rounds to 0 there only).
        for t in (1e-7, 1e-39, 1e-320):
            self.assertEqual(SamplingParams(temperature=t).temperature, 0.0)
        self.assertEqual(SamplingParams(temperature=1e-6).temperature, 1e-6)
        params = {"temperature": 1e-39, "top_k": 5, "sampling_seed": 3}
        out = self._check(dict(params, ignore_eos=True))
        self.assertEqual(out, self.base)

    def test_stop_ids_end_the_request_there(self):
        stops = [ord(" "), ord("(")]
        out = self._check({"stop_token_ids": stops, "ignore_eos": True})
        for got, full in zip(out, self.base):
            cut = next((i for i, t in enumerate(full) if t in stops), None)
            expected = full if cut is None else full[: cut + 1]
            self.assertEqual(got, expected)
        self.assertLess(sum(map(len, out)), sum(map(len, self.base)))

    def test_min_new_tokens_masks_eos_and_stops(self):
        stops = [ord(" ")]
        out = self._check({"stop_token_ids": stops, "min_new_tokens": 12})
        for got in out:
            self.assertGreaterEqual(len(got), 12)
            self.assertFalse(any(t in stops + [EOS] for t in got[:12]))

    def test_min_new_tokens_ends_at_the_first_stop_it_allows(self):
        # Each request's first stop in the unconstrained output, at position
        # p: with min_new_tokens = p the positions before p are masked (none
        # held a stop) and p is not, so the output ends exactly there; with
        # p + 1, p is masked too and the output goes past it.
        stops = [ord(" ")]
        firsts = [next(i for i, t in enumerate(o) if t in stops) for o in self.base]
        self.assertGreater(len(set(firsts)), 2)  # boundaries at several places
        for extra in (0, 1):
            params = [
                dict(max_new_tokens=24, ignore_eos=True, stop_token_ids=stops)
                | {"min_new_tokens": p + extra}
                for p in firsts
            ]
            plain, spark = self._both(params)
            self.assertEqual(spark, plain)
            for out, full, p in zip(plain, self.base, firsts):
                if extra == 0:
                    self.assertEqual(out, full[: p + 1])
                else:
                    self.assertEqual(out[:p], full[:p])
                    self.assertNotIn(out[p], stops)
                    self.assertGreater(len(out), p + 1)

    def test_eos_stops_unless_ignored(self):
        stopped = self._check({})
        self.assertTrue(any(len(o) < 24 and o[-1] == EOS for o in stopped))
        self.assertEqual([len(o) for o in self.base], [24] * len(self.prompts))

    def test_truncation_keeps_the_argmax(self):
        out = self._check({"top_k": 2, "top_p": 0.3, "min_p": 0.2, "ignore_eos": True})
        self.assertEqual(out, self.base)


class TestLogprobs(CustomTestCase):
    def test_equal_between_dspark_and_plain(self):
        prompts = _prompts(4, seed=3)
        res = []
        for algo in (None, "DSPARK"):
            engine = Engine(speculative_algorithm=algo, device="cpu")
            out = engine.generate(
                input_ids=prompts,
                sampling_params={"max_new_tokens": 20, "repetition_penalty": 1.2},
                return_logprob=True,
            )
            res.append(out)
        for a, b in zip(*res):
            self.assertEqual(a["output_ids"], b["output_ids"])
            la, lb = (
                a["meta_info"]["output_token_logprobs"],
                b["meta_info"]["output_token_logprobs"],
            )
            self.assertEqual([t for _, t in la], a["output_ids"])
            self.assertEqual([t for _, t in lb], b["output_ids"])
            torch.testing.assert_close(
                torch.tensor([x for x, _ in la]),
                torch.tensor([x for x, _ in lb]),
                rtol=0,
                atol=1e-4,
            )
            self.assertTrue(all(x <= 0 for x, _ in la))


class TestSeed(CustomTestCase):
    def test_tokens_depend_on_the_seed_alone(self):
        prompts = _prompts(5, seed=4)
        seeded = dict(max_new_tokens=24, temperature=1.0, top_p=0.95, sampling_seed=11)
        others = [dict(max_new_tokens=24, temperature=t) for t in (1.0, 0.7, 0.0, 1.3)]
        plain = Engine(device="cpu", max_running_requests=8)
        spark = Engine(
            speculative_algorithm="DSPARK", device="cpu", max_running_requests=8
        )
        alone = spark.generate(input_ids=prompts[:1], sampling_params=seeded)[0][
            "output_ids"
        ]
        in_batch = spark.generate(input_ids=prompts, sampling_params=[seeded] + others)
        self.assertEqual(in_batch[0]["output_ids"], alone)
        # Plain decoding draws the same noise per position: the same tokens.
        plain_out = plain.generate(input_ids=prompts[:1], sampling_params=seeded)[0]
        self.assertEqual(plain_out["output_ids"], alone)
        other_seed = spark.generate(
            input_ids=prompts[:1], sampling_params=dict(seeded, sampling_seed=12)
        )[0]["output_ids"]
        self.assertNotEqual(other_seed, alone)
        self.assertGreater(in_batch[0]["meta_info"]["spec_accept_length"], 1.5)

    def test_seeded_tokens_equal_plain_at_any_temperature_and_budget(self):
        # At T != 1 (the coupled rule scales the target by 1 / T), on steps
        # that verify nothing (budget 0: the bonus's own seeded noise), and
        # for a greedy request carrying a seed beside a seeded sampled one
        # (it stays greedy): DSpark's tokens are plain decoding's.
        prompts = _prompts(2, seed=6)
        plain = Engine(device="cpu", max_running_requests=4)
        sampled = dict(max_new_tokens=20, temperature=1.0, sampling_seed=3)
        cases = (
            ("T 0.5", {}, [dict(sampled, temperature=0.5, max_new_tokens=40)]),
            ("budget 0", dict(speculative_verify_budget=0), [sampled]),
            (
                "greedy with a seed",
                {},
                [dict(sampled, temperature=0.0, sampling_seed=5), sampled],
            ),
        )
        for name, engine_args, params in cases:
            with self.subTest(name):
                spark = Engine(
                    speculative_algorithm="DSPARK",
                    device="cpu",
                    max_running_requests=4,
                    **engine_args,
                )
                got = spark.generate(
                    input_ids=prompts[: len(params)], sampling_params=params
                )
                want = [
                    plain.generate(input_ids=[ids], sampling_params=sp)[0]
                    for ids, sp in zip(prompts, params)
                ]
                self.assertEqual(
                    [o["output_ids"] for o in got], [o["output_ids"] for o in want]
                )

    def test_seeded_noise_is_exp1_and_its_own_per_position(self):
        seeds = torch.arange(64)
        e = seeded_log_e(seeds, torch.zeros(1, 64, dtype=torch.long), 4096).exp()
        e = e.double()
        self.assertAlmostEqual(e.mean().item(), 1.0, delta=0.02)  # sd 0.002
        self.assertAlmostEqual((e > 1).double().mean().item(), math.exp(-1), delta=0.01)
        two = seeded_log_e(seeds[:1], torch.tensor([[0], [1]]), 256)
        self.assertFalse(torch.equal(two[0], two[1]))


def _processed_p(
    logits: torch.Tensor,
    *,
    top_k=None,
    top_p=None,
    min_p=None,
    counts=None,
    repetition=1.0,
    frequency=0.0,
    presence=0.0,
    seen=None,
) -> torch.Tensor:
    """The processed distribution, by hand (float64): penalties, then the
    truncations, at T = 1."""
    x = logits.double().clone()
    if seen is not None:
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    if counts is not None:
        x = x - frequency * counts - presence * (counts > 0).double()
    p = torch.softmax(x, -1)
    order = torch.argsort(p, descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if top_k is not None and rank >= top_k:
            break
        if top_p is not None and mass > top_p:
            break
        if min_p is not None and p[i] < min_p * p[order[0]]:
            break
        keep[i] = True
        mass += p[i].item()
    p = torch.where(keep, p, torch.zeros_like(p))
    return p / p.sum()


class TestAcceptDistribution(CustomTestCase):
    """The acceptance rule over many identical rows: the first committed
    token follows the processed target distribution; a q truncated unlike
    the draws it judges does not."""

    N, GAMMA, VOCAB = 100_000, 2, 12

    def _run(self, params: dict, wrong_q: bool = False, seed: int = 0) -> float:
        n, g, V = self.N, self.GAMMA, self.VOCAB
        gen = torch.Generator().manual_seed(seed)
        target = torch.randn(V, generator=gen) * 1.5
        draft = target + torch.randn(V, generator=gen)
        v = dspark_step_views(n, g, V)
        st = v.state.sampling
        st.inv_temperatures.fill_(1.0)
        v.state.neg_temperatures.fill_(-1.0)
        v.state.is_sampled.fill_(True)
        st.top_k.fill_(params.get("top_k", V))
        st.top_p.fill_(params.get("top_p", 1.0))
        st.min_p.fill_(params.get("min_p", 0.0))
        st.repetition_penalty.fill_(params.get("repetition", 1.0))
        st.frequency_penalty.fill_(params.get("frequency", 0.0))
        st.presence_penalty.fill_(params.get("presence", 0.0))
        history = torch.zeros(V)
        history[:3] = torch.tensor([2.0, 1.0, 1.0])  # output tokens 0, 0, 1, 2
        st.counts.copy_(history.expand(n, V))
        st.seen.copy_((history > 0).expand(n, V))
        st.out_lens.fill_(4)
        # The draft's processed q for the first slot, and draws from it (the
        # later slot's q: the same, as its history rarely matters here).
        processing = dict(
            top_k=params.get("top_k"),
            top_p=params.get("top_p"),
            min_p=params.get("min_p"),
            counts=history,
            seen=history > 0,
            repetition=params.get("repetition", 1.0),
            frequency=params.get("frequency", 0.0),
            presence=params.get("presence", 0.0),
        )
        q_right = _processed_p(draft, **processing).float()
        drafts = torch.multinomial(
            q_right, n * g, replacement=True, generator=gen
        ).view(n, g)
        q_told = torch.softmax(draft, -1) if wrong_q else q_right  # wrong: untruncated
        v.drafts.copy_(drafts)
        v.q_drafts.copy_(q_told.expand(g, n, V))
        v.u.uniform_(generator=gen)
        draw_log_exp1_(v.log_e, gen)
        logits = target.expand(n, g + 1, V).reshape(-1, V).clone()
        accept(
            views=v,
            target_logits=logits,
            mode=SamplingMode.SAMPLED,
            extras=SamplingExtras(penalized=True, truncated=True),
        )
        first = torch.where(v.accept_lens > 0, drafts[:, 0], v.state.last_ids)
        p = _processed_p(target, **processing)
        # q differs from p (a q equal to p would accept every draft and test
        # nothing), and not so far that every draft is rejected.
        gap = float((q_right - p.float()).abs().max())
        self.assertTrue(0.1 < gap < 0.5, gap)
        return _chi2_goodness(torch.bincount(first, minlength=V), p)

    def test_each_parameter_keeps_the_processed_target(self):
        for params in (
            {"top_k": 3},
            {"top_p": 0.6},
            {"min_p": 0.2},
            {"repetition": 1.5, "frequency": 0.7, "presence": 0.4},
        ):
            with self.subTest(**params):
                self.assertGreater(self._run(params), P_FLOOR)

    def test_a_wrongly_truncated_q_fails(self):
        for params in ({"top_k": 3}, {"top_p": 0.6}):
            with self.subTest(**params):
                self.assertLess(self._run(params, wrong_q=True), P_FLOOR)


class TestRaggedScheduleDistribution(CustomTestCase):
    """A ragged verify shares its budget by confidence; a sampled row's
    share must not depend on its own drafts, or the output leaves p (a
    high-q draft judged more often skews it)."""

    N, GAMMA, VOCAB = 100_000, 2, 6

    def _run(self, blind: bool) -> list:
        n, g, V = self.N, self.GAMMA, self.VOCAB
        gen = torch.Generator().manual_seed(0)
        target = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5])
        q = torch.softmax(torch.tensor([0.0, 1.0, 2.5, 0.5, 1.0, -1.0]), -1)
        v = dspark_step_views(n, g, V)
        v.state.inv_temperatures.fill_(1.0)
        v.state.neg_temperatures.fill_(-1.0)
        v.state.is_sampled.fill_(True)
        drafts = torch.multinomial(q, n * g, replacement=True, generator=gen)
        drafts = drafts.view(n, g)
        v.drafts.copy_(drafts)
        v.q_drafts.copy_(q.expand(g, n, V))
        v.u.uniform_(generator=gen)
        draw_log_exp1_(v.log_e, gen)
        budget = n + n // 2  # half the requests verify both drafts
        ScheduleVerifyLensTopk.execute(
            confidence=q[drafts].t().contiguous(),  # each draft's q(d)
            budget=budget,
            verify_lens=v.verify_lens,
            gains=torch.empty(g, n),
            top_values=torch.empty(budget),
            top_index=torch.empty(budget, dtype=torch.int64),
            ones=torch.ones(budget, dtype=torch.int64),
            blind=v.state.is_sampled if blind else None,
            blind_gains=blind_gains(g, "cpu"),
        )
        logits = target.expand(n, g + 1, V).reshape(-1, V).clone()
        accept(
            views=v,
            target_logits=logits,
            mode=SamplingMode.SAMPLED,
            query_index=torch.arange(n * (g + 1)),  # every place, judged or not
        )
        a, bonus, p = v.accept_lens, v.state.last_ids, torch.softmax(target, -1)
        first = torch.where(a > 0, drafts[:, 0], bonus)
        on = a >= 1  # the second token, where the first was a draft
        second = torch.where(a[on] > 1, drafts[on, 1], bonus[on])
        if blind:  # an equal share: every first draft, half the second ones
            self.assertEqual(sorted(set(v.verify_lens.tolist())), [1, 2])
        return [
            _chi2_goodness(torch.bincount(t, minlength=V), p) for t in (first, second)
        ]

    def test_blind_rows_keep_the_target(self):
        for pv in self._run(blind=True):
            self.assertGreater(pv, P_FLOOR)

    def test_rows_scheduled_by_their_own_drafts_do_not(self):
        for pv in self._run(blind=False):
            self.assertLess(pv, P_FLOOR)


class TestEngineDistribution(CustomTestCase):
    """End to end, at T = 1: the first two tokens of DSpark's requests
    against plain decoding's (two-sample chi-square), per parameter."""

    N = 600

    def test_dspark_samples_what_plain_samples(self):
        prompt = _prompts(1, seed=5)[0]
        args = dict(device="cpu", max_running_requests=64, random_seed=1)
        plain = Engine(**args)
        # A fixed budget, so the samples are the same every run ("auto" plans
        # from measured step times): ragged verifies at 64 requests (150 of
        # 320 drafts), every draft at the last 24.
        spark = Engine(
            speculative_algorithm="DSPARK", speculative_verify_budget=150, **args
        )
        for params in (
            {"top_k": 4},
            {"top_p": 0.7},
            {"min_p": 0.1},
            {
                "repetition_penalty": 1.5,
                "frequency_penalty": 0.5,
                "presence_penalty": 0.5,
            },
        ):
            with self.subTest(**params):
                sp = dict(max_new_tokens=3, temperature=1.0, **params)
                samples = []
                for engine in (plain, spark):
                    out = engine.generate(
                        input_ids=[prompt] * self.N, sampling_params=sp
                    )
                    pairs = {}
                    for r in out:
                        key = tuple(r["output_ids"][1:3])  # decode-step tokens
                        pairs[key] = pairs.get(key, 0) + 1
                    samples.append(pairs)
                self.assertGreater(_chi2_two_sample(*samples), P_FLOOR)


class TestDraftHealth(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.root = tempfile.mkdtemp()
        target = load_target("random-tiny-moe", seed=3, device="cpu")
        draft = load_draft("random-tiny-moe", target=target, seed=3, device="cpu")
        cls.draft_dir = os.path.join(cls.root, "draft")
        save_checkpoint(cls.draft_dir, draft=draft)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.root)
        super().tearDownClass()

    def test_a_nan_draft_is_refused_at_load(self):
        bad = os.path.join(self.root, "nan")
        shutil.copytree(self.draft_dir, bad)
        path = os.path.join(bad, WEIGHTS_NAME)
        tensors = load_file(path)
        name = sorted(tensors)[0]
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[3] = float("nan")
        save_file(tensors, path, metadata={"format": "pt"})
        with self.assertRaisesRegex(ValueError, f"tensor '{name}' has 1 non-finite"):
            Engine(
                speculative_algorithm="DSPARK",
                device="cpu",
                speculative_draft_model_path=bad,
            )

    def test_a_draft_never_accepted_is_logged_once(self):
        # An untrained draft beside the trained target: its blocks are
        # almost never accepted; the output stays the target's.
        engine = Engine(
            speculative_algorithm="DSPARK",
            device="cpu",
            speculative_draft_model_path=self.draft_dir,
            speculative_verify_budget="off",
            max_running_requests=8,
        )
        with self.assertLogs("sglang.srt.managers.scheduler", level="WARNING") as logs:
            out = engine.generate(
                input_ids=_prompts(8, seed=6), sampling_params={"max_new_tokens": 40}
            )
            engine.generate(
                input_ids=_prompts(8, seed=7), sampling_params={"max_new_tokens": 40}
            )
        warnings = [m for m in logs.output if "almost never accepted" in m]
        self.assertEqual(len(warnings), 1)
        running = out[0]["meta_info"]["spec_running_accept_length"]
        self.assertLess(running, 1.05)
        self.assertGreaterEqual(running, 1.0)
        plain = Engine(device="cpu", max_running_requests=8).generate(
            input_ids=_prompts(8, seed=6), sampling_params={"max_new_tokens": 40}
        )
        self.assertEqual(
            [o["output_ids"] for o in out], [o["output_ids"] for o in plain]
        )

    def test_the_trained_pair_reports_its_running_accept_length(self):
        engine = Engine(speculative_algorithm="DSPARK", device="cpu")
        out = engine.generate(
            input_ids=_prompts(4), sampling_params={"max_new_tokens": 32}
        )
        self.assertGreater(out[0]["meta_info"]["spec_running_accept_length"], 2.0)


if __name__ == "__main__":
    unittest.main()
