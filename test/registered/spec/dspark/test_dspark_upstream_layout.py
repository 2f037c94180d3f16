"""Upstream SGLang's module paths and names: an upstream diff or test applies
here unchanged, and the pre-port paths are gone (one home per concept)."""

import ast
import importlib
import unittest
from pathlib import Path

import sglang
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=3, suite="base-a-test-cpu")

SRT = Path(sglang.__file__).resolve().parent / "srt"

# upstream module -> names a porter imports from it
UPSTREAM = {
    "sglang.srt.speculative.dspark_components.dspark_draft": (
        "_make_num_token_non_padded",
        "DraftBlockProposer",
        "DraftProposal",
        "enable_num_token_non_padded",
    ),
    "sglang.srt.speculative.dspark_components.dspark_planner": ("VerifyWindow",),
    "sglang.srt.speculative.dspark_components.dspark_config": ("DSparkConfig",),
    "sglang.srt.speculative.dspark_components.dspark_verify": (
        "accept",
        "greedy_accept",
        "rejection_accept",
    ),
    "sglang.srt.speculative.dspark_components.dspark_worker_v2": ("DSparkWorkerV2",),
    "sglang.srt.models.dspark": ("DSparkDraftModel",),
    "sglang.srt.runtime_context": ("get_parallel",),
    "sglang.srt.model_executor.forward_batch_info": (
        "ForwardBatch",
        "ForwardMode",
        "CaptureHiddenMode",
        "ModelOutput",
        "enable_num_token_non_padded",
    ),
    "sglang.srt.arg_groups.speculative_hook": (
        "_handle_dspark",
        "_target_checkpoint_bundles_dspark_draft",
    ),
    "sglang.test.ci.ci_register": ("register_cpu_ci", "register_cuda_ci"),
    "sglang.test.test_utils": ("CustomTestCase",),
}

GONE = (
    "sglang.srt.speculative.dspark",
    "sglang.srt.speculative.dspark.draft",
    "sglang.srt.models.dspark_draft",
)


class TestUpstreamLayout(CustomTestCase):
    def test_upstream_paths_import(self):
        for module, names in UPSTREAM.items():
            with self.subTest(module=module):
                mod = importlib.import_module(module)
                for name in names:
                    self.assertTrue(hasattr(mod, name), f"{module}.{name}")

    def test_old_paths_are_gone(self):
        for module in GONE:
            with self.subTest(module=module):
                with self.assertRaises(ModuleNotFoundError):
                    importlib.import_module(module)
        self.assertFalse((SRT / "speculative" / "dspark").exists())
        from sglang.srt.distributed import parallel_state

        for old in ("ParallelState", "set_parallel"):
            self.assertFalse(hasattr(parallel_state, old), old)

    def test_one_predicate_object(self):
        from sglang.srt.model_executor import forward_batch_info
        from sglang.srt.speculative.dspark_components import dspark_draft

        self.assertIs(
            dspark_draft.enable_num_token_non_padded,
            forward_batch_info.enable_num_token_non_padded,
        )

    def test_managers_import_no_private_speculative_names(self):
        for path in sorted((SRT / "managers").glob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and "speculative" in (
                    node.module or ""
                ):
                    private = [a.name for a in node.names if a.name.startswith("_")]
                    with self.subTest(file=path.name, module=node.module):
                        self.assertEqual(private, [])

    def test_draft_block_has_its_own_forward_mode(self):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        self.assertTrue(ForwardMode.DRAFT_EXTEND_V2.is_draft_extend_v2())
        self.assertFalse(ForwardMode.DRAFT_EXTEND_V2.is_target_verify())

    def test_enums_have_upstreams_values_and_meanings(self):
        # Upstream's values (a mode sent or stored as an int means the same),
        # and its is_extend: a target verify is an extend, the draft's
        # extend only when asked.
        from sglang.srt.model_executor.forward_batch_info import (
            CaptureHiddenMode,
            ForwardMode,
        )

        self.assertEqual(
            {m.name: m.value for m in ForwardMode},
            dict(
                EXTEND=1,
                DECODE=2,
                MIXED=3,
                IDLE=4,
                TARGET_VERIFY=5,
                DRAFT_EXTEND_V2=6,
            ),
        )
        self.assertEqual(
            {m.name: m.value for m in CaptureHiddenMode},
            dict(NULL=0, LAST=1, FULL=2),
        )
        extend = {m for m in ForwardMode if m.is_extend()}
        self.assertEqual(
            extend,
            {ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY},
        )
        self.assertTrue(ForwardMode.DRAFT_EXTEND_V2.is_extend(True))
        self.assertFalse(ForwardMode.TARGET_VERIFY.is_extend_without_speculative())
        self.assertTrue(CaptureHiddenMode.FULL.is_full())
        self.assertTrue(CaptureHiddenMode.LAST.is_last())

    def test_layers_import_nothing_above_them(self):
        # layers/ take what they need as arguments: no import of the batch
        # types (model_executor), the managers or the models above them.
        above = ("model_executor", "managers", "models", "speculative", "entrypoints")
        for path in sorted((SRT / "layers").rglob("*.py")):
            for module in _imports(path):
                with self.subTest(file=path.name, module=module):
                    self.assertFalse(
                        any(module.startswith(f"sglang.srt.{a}") for a in above)
                    )

    def test_model_executor_imports_no_model(self):
        for path in sorted((SRT / "model_executor").glob("*.py")):
            for module in _imports(path):
                with self.subTest(file=path.name, module=module):
                    self.assertFalse(module.startswith("sglang.srt.models"))

    def test_scheduler_drives_workers_by_interface(self):
        # The Engine hands the scheduler its worker; the scheduler names no
        # worker class.
        modules = _imports(SRT / "managers" / "scheduler.py")
        self.assertFalse([m for m in modules if "speculative" in m or "tp_worker" in m])

    def test_one_accept_implementation_per_rule_one_view_cache(self):
        defs = {}
        for path in sorted(SRT.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef):
                    defs.setdefault(node.name, []).append(path.name)
        self.assertEqual(defs["greedy_accept"], ["dspark_verify.py"])
        self.assertEqual(defs["rejection_accept"], ["dspark_verify.py"])
        self.assertNotIn("greedy_verify", defs)
        self.assertNotIn("rejection_verify_into", defs)
        # Per-batch-size views are cut in one place: StepBuffers.at.
        caches = [
            path.name
            for path in sorted(SRT.rglob("*.py"))
            if "self._views" in path.read_text()
        ]
        self.assertEqual(caches, ["step_buffers.py"])

    def test_only_the_proposer_calls_the_draft_helper(self):
        callers = []
        for path in sorted(SRT.rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "_make_num_token_non_padded"
                ):
                    callers.append(path.relative_to(SRT).as_posix())
        # The block's own count, and its DP-synced one.
        self.assertEqual(callers, ["speculative/dspark_components/dspark_draft.py"] * 2)


def _imports(path: Path) -> list:
    """The sglang modules a file imports (also under TYPE_CHECKING)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return [m for m in found if m.startswith("sglang")]


if __name__ == "__main__":
    unittest.main()
