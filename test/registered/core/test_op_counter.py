"""OpCounter counts what torch dispatches; count_calls counts chosen methods'
ops in a nested counter (a counted call inside another once); routed puts
back whatever it replaced, also when it fails midway."""

import types
import unittest

import torch

from sglang.srt.utils.op_counter import OpCounter, count_calls, routed
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=1, suite="base-a-test-cpu")


class _Model:
    def forward(self, x):
        return self.inner(x) + 1  # one add here, one mul inside

    def inner(self, x):
        return x * 2


class _NoSetting:
    """Takes any attribute but ``frozen``."""

    def __setattr__(self, name, value):
        if name == "frozen":
            raise AttributeError("frozen")
        super().__setattr__(name, value)


class TestCountCalls(CustomTestCase):
    def test_glue_is_outer_minus_inner(self):
        model, x = _Model(), torch.ones(3)
        with count_calls([(model, "forward"), (model, "inner")]) as inner:
            with OpCounter() as outer:
                model.forward(x)  # counted: add and mul; inner() nested, once
                x.sub(1)  # glue
        self.assertEqual(inner.ops, 2)
        self.assertEqual(outer.ops, 3)
        self.assertEqual(outer.allocs - inner.allocs, 1)
        # The class's methods show through again.
        self.assertNotIn("forward", vars(model))
        self.assertNotIn("inner", vars(model))


class TestRouted(CustomTestCase):
    def test_puts_back_what_was_there(self):
        model = _Model()
        spy = lambda x: "spy"  # noqa: E731 (an instance attribute already set)
        model.inner = spy
        model.hook = None  # an attribute that is None is one all the same
        module = types.ModuleType("m")
        module.f = len
        replacements = [
            (model, "forward", lambda x: "a"),
            (model, "inner", lambda x: "b"),
            (module, "f", lambda x: "c"),
            (module, "f", lambda x: "d"),  # the same attribute twice
            (model, "hook", print),
        ]
        with routed(replacements):
            self.assertEqual(
                (model.forward(0), model.inner(0), module.f(0)), ("a", "b", "d")
            )
        self.assertNotIn("forward", vars(model))
        self.assertIs(model.inner, spy)
        self.assertIs(module.f, len)
        self.assertIn("hook", vars(model))
        self.assertIsNone(model.hook)

    def test_a_failure_midway_puts_back_the_ones_set(self):
        obj = _NoSetting()
        obj.kept = 1
        with self.assertRaisesRegex(AttributeError, "frozen"):
            with routed([(obj, "kept", 2), (obj, "frozen", 3)]):
                self.fail("not reached")
        self.assertEqual(obj.kept, 1)
        self.assertNotIn("frozen", vars(obj))

    def test_a_failing_restore_does_not_skip_the_others(self):
        first, second = _Model(), _Model()
        with self.assertRaises(AttributeError):
            with routed([(first, "forward", None), (second, "forward", None)]):
                del second.forward  # its restore (a delattr) now fails
        self.assertNotIn("forward", vars(first))  # restored all the same

    def test_an_exception_inside_puts_everything_back(self):
        model = _Model()
        with self.assertRaises(KeyError):
            with routed([(model, "forward", None)]):
                raise KeyError("inside")
        self.assertNotIn("forward", vars(model))
        self.assertEqual(model.forward(torch.ones(1)).item(), 3.0)


if __name__ == "__main__":
    unittest.main()
