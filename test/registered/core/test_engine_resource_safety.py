"""Nothing wedges the engine: whatever ends a ``generate()`` early (an
exception in prefill or decode, a raising progress callback, a
KeyboardInterrupt injected or delivered at a random moment) aborts that
call's requests and returns every request row and KV slot before the
exception leaves; the engine stays usable and later outputs are unchanged.
A step that can neither admit nor run anything raises instead of spinning.
Two threads calling ``generate()`` on one engine are serialized.

After every call: free + held == total for request rows and KV slots
(``Scheduler.check_pool_accounting``) and nothing is left queued.
"""

import _thread
import contextlib
import functools
import random
import sys
import threading
import time
import unittest
from unittest import mock

from sglang import Engine
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool, TokenSlotAllocator
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase, queue_requests

register_cpu_ci(est_time=15, suite="base-a-test-cpu")

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]]
PARAMS = {"max_new_tokens": 12}
ARGS = dict(device="cpu", context_length=64, max_total_tokens=512)
ALGORITHMS = ("DSPARK", None)


class Injected(Exception):
    pass


class EngineCase(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.engines = {a: Engine(speculative_algorithm=a, **ARGS) for a in ALGORITHMS}
        cls.expected = {a: cls._outputs(e) for a, e in cls.engines.items()}

    @staticmethod
    def _outputs(engine, prompts=PROMPTS, **kw):
        outs = engine.generate(input_ids=prompts, sampling_params=PARAMS, **kw)
        return [o["output_ids"] for o in outs]

    def assert_whole(self, engine):
        sched = engine.scheduler
        sched.check_pool_accounting()
        self.assertFalse(sched.has_work())
        self.assertEqual(
            engine.req_to_token_pool.available(), engine.req_to_token_pool.max_reqs
        )
        self.assertEqual(engine.allocator.available(), engine.allocator.num_slots)

    def assert_usable(self, algo):
        engine = self.engines[algo]
        self.assert_whole(engine)
        self.assertEqual(self._outputs(engine), self.expected[algo])
        self.assert_whole(engine)

    def each_engine(self):
        for algo, engine in self.engines.items():
            with self.subTest(algo=algo):
                yield algo, engine


class TestFailuresReleaseEverything(EngineCase):
    @contextlib.contextmanager
    def failing(self, engine, name, fail_on_call, exc):
        """``engine.worker.<name>`` raises ``exc`` on its Nth call, after the
        real call ran (so the worker's batch state is half-advanced)."""
        original = getattr(engine.worker, name)
        calls = [0]

        def flaky(**kw):
            calls[0] += 1
            out = original(**kw)
            if calls[0] == fail_on_call:
                raise exc
            return out

        setattr(engine.worker, name, flaky)
        try:
            yield calls
        finally:
            delattr(engine.worker, name)

    def test_prefill_exception_after_others_were_admitted(self):
        # The 2nd request's prefill fails: the 1st was admitted in the same
        # step and must not be left neither waiting nor running.
        for algo, engine in self.each_engine():
            with self.failing(engine, "prefill", 2, Injected("prefill")):
                with self.assertRaises(Injected):
                    self._outputs(engine)
            self.assert_usable(algo)

    def test_decode_exception(self):
        for algo, engine in self.each_engine():
            with self.failing(engine, "decode_step", 3, Injected("decode")) as calls:
                with self.assertRaises(Injected):
                    self._outputs(engine)
            self.assertEqual(calls[0], 3)
            self.assert_usable(algo)

    def test_keyboard_interrupt_in_prefill_and_decode(self):
        for name in ("prefill", "decode_step"):
            for algo, engine in self.each_engine():
                with self.failing(engine, name, 2, KeyboardInterrupt()):
                    with self.assertRaises(KeyboardInterrupt):
                        self._outputs(engine)
                self.assert_usable(algo)

    def test_raising_progress_callback(self):
        for exc in (Injected("progress"), KeyboardInterrupt()):
            for algo, engine in self.each_engine():
                steps = [0]

                def progress(n, exc=exc):
                    steps[0] += 1
                    if steps[0] == 3:
                        raise exc

                with self.assertRaises(type(exc)):
                    self._outputs(engine, progress=progress)
                self.assertEqual(steps[0], 3)
                self.assert_usable(algo)

    def test_keyboard_interrupt_at_random_moments(self):
        # A real asynchronous interrupt (as Ctrl-C delivers it), at a random
        # moment of the call: before the fix 20 of 30 such calls leaked a row.
        rng = random.Random(0)
        for algo, engine in self.each_engine():
            start = time.perf_counter()
            self._outputs(engine)
            duration = time.perf_counter() - start
            interrupted = 0  # interrupts that landed inside a call
            for _ in range(25):
                timer = threading.Timer(
                    rng.uniform(0, duration), _thread.interrupt_main
                )
                inside = False
                try:
                    timer.start()
                    inside = True
                    self._outputs(engine)
                    inside = False
                    timer.join()
                    time.sleep(0.005)  # a late interrupt lands here, not later
                except KeyboardInterrupt:
                    interrupted += inside
                timer.cancel()
                self.assert_whole(engine)
            self.assertGreater(interrupted, 0)
            self.assert_usable(algo)

    def test_decode_exception_keeps_scheduler_consistent(self):
        # Used directly (no generate()), a failed step leaves its requests
        # running; the batch is rebuilt from host state, so finishing them
        # gives exactly the outputs of a run that never failed.
        for algo, engine in self.each_engine():
            sched = engine.scheduler
            reqs = queue_requests(sched, PROMPTS, max_new_tokens=12, first_rid=1000)
            sched.step()
            with self.failing(engine, "decode_step", 1, Injected("decode")):
                with self.assertRaises(Injected):
                    sched.step()
            sched.check_pool_accounting()
            self.assertEqual(len(sched.running), 3)
            while sched.has_work():
                sched.step()
            self.assertEqual([r.output_ids for r in reqs], self.expected[algo])
            self.assert_usable(algo)

    def test_a_partial_abort_keeps_a_dp_round_stepping(self):
        # Under DP attention a rank steps on while any rank had work at the
        # last sync (``_dp_busy``, set here as that sync leaves it). Aborting
        # some of its requests must not end the round for the others (the
        # rank would stop stepping while its peers wait for it); aborting
        # the last one ends it.
        sched = self.engines[None].scheduler
        reqs = queue_requests(sched, PROMPTS, max_new_tokens=12, first_rid=2000)
        sched.step()
        sched._dp_busy = True
        sched.abort_requests(reqs[:1])
        self.assertTrue(sched._dp_busy)
        self.assertEqual(len(sched.running), 2)
        self.assertEqual(reqs[0].finished_reason, "abort")
        sched.check_pool_accounting()
        sched.abort_requests(reqs[1:])
        self.assertFalse(sched._dp_busy)
        self.assert_usable(None)

    def test_an_interrupted_abort_is_finished_by_the_next_call_or_flush(self):
        # A decode step fails and a second interrupt lands in the abort that
        # follows: the call's requests still hold their rows. The next
        # generate() finishes the abort first, and so does flush_cache()
        # (the engine is idle: the call is over).
        for algo, engine in self.each_engine():
            for then in ("generate", "flush_cache"):
                sched, real = engine.scheduler, engine.scheduler.abort_requests
                calls = [0]

                def abort_once_interrupted(reqs):
                    calls[0] += 1
                    if calls[0] == 1:
                        raise KeyboardInterrupt
                    return real(reqs)

                with (
                    self.failing(engine, "decode_step", 2, Injected("decode")),
                    mock.patch.object(sched, "abort_requests", abort_once_interrupted),
                ):
                    with self.assertRaises(KeyboardInterrupt):
                        self._outputs(engine)
                    self.assertTrue(sched.has_work())  # still held
                    with self.subTest(then=then):
                        if then == "flush_cache":
                            self.assertTrue(engine.flush_cache())
                            self.assert_whole(engine)
                        else:
                            self.assertEqual(self._outputs(engine), self.expected[algo])
                        self.assertEqual(calls[0], 2)
                self.assert_usable(algo)

    def test_interrupt_while_a_steps_tokens_are_appended(self):
        # Used directly, a step interrupted after the worker returned, while
        # the host appends the step's tokens to its requests: some have them
        # and some not, while the batch's device state has them all. The
        # batch is rebuilt from the requests, those already finished leave
        # with their KV returned, and finishing the rest gives exactly the
        # outputs of a run that never failed. Every append of the run is
        # interrupted in turn: the first, middle and last request's of each
        # step, those of the steps where requests finish among them.
        # Each request's speculation counts too: counted once per step it
        # ran to the end, as in the run that never failed.
        self._interrupt_each_call(lambda sched: (Req, "append_tokens"), least=6)

    def test_an_interrupted_retirement_or_join_is_finished_by_the_next_step(self):
        # Used directly, a step interrupted as it retires its finished
        # requests (each call in turn) leaves them in the running batch: the
        # next step retires them before anything else, so none decodes past
        # its end (its counts would show the extra step). One interrupted as
        # admitted requests join (the first step's included, which admits
        # them all) leaves them admitted: the scheduler still has work, and
        # the next step joins them.
        for name, admission in (("_retire_finished", False), ("_join", True)):
            with self.subTest(name=name):
                self._interrupt_each_call(
                    lambda sched: (sched, name), least=3, admission=admission
                )

    def _interrupt_each_call(self, where, least, admission=False):
        """Run PROMPTS through each engine's scheduler with, in turn, each
        call of ``where(scheduler)`` (an object and an attribute) during the
        decode steps (``admission``: and the first step) interrupted: the outputs, the pools and every request's
        speculation counts are those of the run that was not. DSpark
        verifies every draft here: the default budget plans from measured
        step times, so its steps, and with them the counts, move between
        runs (the outputs do not)."""
        engines = {
            "DSPARK": Engine(
                speculative_algorithm="DSPARK", speculative_verify_budget="off", **ARGS
            ),
            None: self.engines[None],
        }
        for algo, engine in engines.items():
            with self.subTest(algo=algo):
                obj, name = where(engine.scheduler)
                run = functools.partial(
                    self._run_interrupting, engine, algo, obj, name, admission
                )
                calls, counts = run(None)
                self.assertGreater(calls, least)
                for fail_at in range(1, calls + 1):
                    with self.subTest(fail_at=fail_at):
                        _, got = run(fail_at)
                        self.assertEqual(got, counts)
                self.assertEqual(self._outputs(engine), self.expected[algo])
                self.assert_whole(engine)

    def _run_interrupting(self, engine, algo, obj, name, admission, fail_at):
        """Run PROMPTS through the scheduler, the ``fail_at``-th call of
        ``obj.name`` in its decode steps (``admission``: and in the first
        step) interrupted (None: none); check the outputs and the pools. Returns how many calls the decode steps made, and each
        request's (steps, accepted drafts, verified drafts)."""
        sched, real, calls = engine.scheduler, getattr(obj, name), [0]

        def flaky(*args, **kw):
            calls[0] += 1
            if calls[0] == fail_at:
                raise KeyboardInterrupt
            return real(*args, **kw)

        reqs = queue_requests(sched, PROMPTS, max_new_tokens=12, first_rid=3000)
        if not admission:
            sched.step()  # admission, prefill and a first decode
        interrupted = False
        with mock.patch.object(obj, name, flaky):
            while sched.has_work():
                try:
                    sched.step()
                except KeyboardInterrupt:
                    interrupted = True
                    sched.check_pool_accounting()
                    if name != "_retire_finished":  # (that one is the release)
                        finished = [r.rid for r in sched.running if r.finished]
                        self.assertEqual(finished, [])  # released, not running
        self.assertEqual(interrupted, fail_at is not None)
        self.assertEqual([r.output_ids for r in reqs], self.expected[algo])
        self.assert_whole(engine)
        counts = [
            (r.spec_verify_ct, r.spec_accepted_drafts, r.spec_verified_drafts)
            for r in reqs
        ]
        return calls[0], counts

    def test_an_interrupt_anywhere_in_flush_cache_leaves_the_lock_free(self):
        # CPython raises a pending Ctrl-C where it checks for signals: as a
        # function starts and as a call returns (never before a call
        # starts), the lock's own acquire included (the lock then taken). A
        # profile hook raises at each such point inside flush_cache() in
        # turn; the engine lock is free after each, and the engine flushes
        # and runs.
        for algo, engine in self.each_engine():
            k = 0
            while True:
                k += 1
                events, armed = [0], [True]

                def interrupt(frame, event, arg):
                    if armed[0] and event in ("call", "return", "c_return"):
                        events[0] += 1
                        if events[0] == k:
                            armed[0] = False
                            raise KeyboardInterrupt

                try:
                    sys.setprofile(interrupt)
                    flushed = engine.flush_cache()
                except KeyboardInterrupt:
                    flushed = None
                finally:
                    armed[0] = False
                    sys.setprofile(None)
                leaked = engine._lock.locked()
                if leaked:  # free it, so that the engine's other tests run
                    engine._lock.release()
                self.assertFalse(leaked, f"the lock is held after event {k}")
                if flushed is not None:
                    self.assertTrue(flushed)
                    break
            self.assertGreater(k, 5)
            self.assert_usable(algo)

    def test_prefill_exception_keeps_scheduler_consistent(self):
        # Used directly, the request whose prefill failed is aborted with its
        # KV returned; the one admitted before it in the same step runs on.
        for algo, engine in self.each_engine():
            sched = engine.scheduler
            reqs = queue_requests(sched, PROMPTS, max_new_tokens=12, first_rid=2000)
            with self.failing(engine, "prefill", 2, Injected("prefill")):
                with self.assertRaises(Injected):
                    sched.step()
            sched.check_pool_accounting()
            self.assertEqual([r.rid for r in sched.running], [2000])
            self.assertEqual(reqs[1].finished_reason, "abort")
            self.assertIsNone(reqs[1].req_pool_idx)
            while sched.has_work():
                sched.step()
            self.assertEqual(reqs[0].output_ids, self.expected[algo][0])
            self.assertEqual(reqs[2].output_ids, self.expected[algo][2])
            self.assert_usable(algo)


class TestPoolsRefuseMisuse(CustomTestCase):
    def test_a_slot_or_row_freed_twice_or_out_of_range(self):
        # Freed twice, a slot or row would later serve two requests; slot 0
        # and row 0 are the scratch slot and the dummy request's row.
        slots = TokenSlotAllocator(8)
        held = slots.alloc(3)
        for bad in ([0], [9], [held[0], held[0]], [held[0], 4]):
            with self.subTest(slots=bad):
                with self.assertRaisesRegex(ValueError, "is not allocated"):
                    slots.free(bad)
                self.assertEqual(slots.available(), 5)  # nothing was freed
        slots.free(held)
        self.assertEqual(sorted(slots.free_slots()), list(range(1, 9)))
        rows = ReqToTokenPool(max_reqs=2, max_context_len=4, device="cpu")
        row = rows.alloc()
        for bad in (0, -1, 3, 2 if row == 1 else 1):
            with self.subTest(row=bad):
                with self.assertRaisesRegex(ValueError, "is not allocated"):
                    rows.free(bad)
        rows.free(row)
        self.assertEqual(rows.available(), 2)


class TestStepTimes(EngineCase):
    def test_times_are_kept_only_while_recorded(self):
        # A long-lived engine keeps a count of its decode steps, not a list
        # of their times; a recording gets each step taken inside it.
        for _, engine in self.each_engine():
            sched = engine.scheduler
            before = sched.num_decode_steps
            self._outputs(engine)
            unrecorded = sched.num_decode_steps - before
            self.assertGreater(unrecorded, 0)
            with sched.record_step_times() as times:
                self._outputs(engine)
                with sched.record_step_times() as inner:  # nested: both get it
                    self._outputs(engine)
            self.assertEqual(len(inner), unrecorded)
            self.assertEqual(len(times), 2 * unrecorded)
            self.assertEqual(times[unrecorded:], inner)
            self.assertTrue(all(t > 0 for t in times))
            self.assertEqual(sched.num_decode_steps - before, 3 * unrecorded)
            self.assertEqual(sched._step_times, [])  # nothing kept after
            # Two recordings opened together hold equal lists: each closes
            # its own.
            with sched.record_step_times() as outer:
                with sched.record_step_times() as inner:
                    self._outputs(engine)
                self._outputs(engine)
            self.assertEqual((len(inner), len(outer)), (unrecorded, 2 * unrecorded))
            self.assertEqual(sched._step_times, [])


class TestNoSilentSpin(EngineCase):
    def test_missing_row_or_slots_is_an_error_naming_them(self):
        for algo, engine in self.each_engine():
            for what, steal, needle in (
                (
                    "rows",
                    lambda: [
                        engine.req_to_token_pool.alloc()
                        for _ in range(engine.req_to_token_pool.max_reqs)
                    ],
                    r"needs 1 request row \(0 of 8 free\)",
                ),
                (
                    "slots",
                    lambda: engine.allocator.alloc(engine.allocator.num_slots - 4),
                    r"KV slots \(4 of 512 free\)",
                ),
            ):
                with self.subTest(what=what):
                    steal()  # held by no request: a leak
                    with self.assertRaisesRegex(
                        RuntimeError, "scheduler stuck.*" + needle
                    ):
                        self._outputs(engine)
                    # The failed call's clean-up rebuilt the free lists.
                    self.assert_usable(algo)


class TestConcurrentCalls(EngineCase):
    def test_two_threads_get_their_own_results(self):
        other = [[11, 12, 13], [200, 7]]
        for algo, engine in self.each_engine():
            expected_other = self._outputs(engine, other)
            results, errors = {}, []
            barrier = threading.Barrier(2)

            def worker(name, prompts):
                try:
                    barrier.wait()
                    results[name] = [self._outputs(engine, prompts) for _ in range(3)]
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            threads = [
                threading.Thread(target=worker, args=("a", PROMPTS)),
                threading.Thread(target=worker, args=("b", other)),
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            self.assertEqual(errors, [])
            self.assertEqual(results["a"], [self.expected[algo]] * 3)
            self.assertEqual(results["b"], [expected_other] * 3)
            self.assert_whole(engine)

    def test_generate_from_its_own_progress_callback_is_an_error(self):
        for algo, engine in self.each_engine():

            def progress(_):
                engine.generate(input_ids=[[1, 2]], sampling_params=PARAMS)

            with self.assertRaisesRegex(RuntimeError, "inside its own progress"):
                self._outputs(engine, progress=progress)
            self.assert_usable(algo)


if __name__ == "__main__":
    unittest.main()
