"""Engine arguments: every ServerArgs field is typed and range-checked with a
ValueError naming it, before anything is allocated; the pools' memory is
computed up front (and equals what the engine then allocates); options the
chosen algorithm would ignore are refused."""

import os
import tempfile
import unittest
import weakref
from unittest import mock

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sglang import Engine
from sglang.srt.layers.moe.ep_moe import EPMoE
from sglang.srt.managers.tp_worker import DecodeBuffers
from sglang.srt.mem_cache.memory_pool import available_memory_bytes
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.runtime_context import get_parallel
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.dspark_components.dspark_buffers import DSparkStepBuffers
from sglang.srt.speculative.dspark_components.dspark_cost_table import VerifyCostTable
from sglang.srt.utils.common import MAX_NUM_THREADS
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase, cuda_available

register_cpu_ci(est_time=3, suite="base-a-test-cpu")
register_cuda_ci(est_time=3, stage="base-b", runner_config="1-gpu-large")


class TestServerArgsValidation(CustomTestCase):
    def test_each_bad_value_names_the_field(self):
        cases = [
            ({"model_path": 3}, "model_path must be a str, got 3"),
            ({"device": 0}, "device must be a str or torch.device, got int 0"),
            ({"device": "tpu"}, "device 'tpu' is not a device name"),
            ({"device": "meta"}, "device must be cpu or cuda, got 'meta'"),
            (
                {"random_seed": True},
                r"random_seed must be an int in \[0, 2\*\*63\), got True",
            ),
            ({"random_seed": None}, "random_seed .* got None"),
            ({"random_seed": 2**64}, "random_seed .* got 18446744073709551616"),
            ({"random_seed": -1}, "random_seed .* got -1"),
            ({"random_seed": 1.0}, "random_seed .* got 1.0"),
            (
                {"max_running_requests": "8"},
                "max_running_requests must be an int >= 1, got '8'",
            ),
            ({"max_total_tokens": 0}, "max_total_tokens .* got 0"),
            ({"context_length": 64.0}, "context_length .* got 64.0"),
            ({"context_length": 1}, "context_length=1 fits no request: .* needs 2$"),
            ({"cuda_graph_bs": [1.5]}, r"cuda_graph_bs .* got \[1.5\]"),
            ({"cuda_graph_bs": []}, r"cuda_graph_bs .* got \[\]"),
            ({"cuda_graph_bs": 4}, "cuda_graph_bs .* got 4"),
            ({"cuda_graph_bs": [True]}, r"cuda_graph_bs .* got \[True\]"),
            (
                {"eos_token_id": 9999},
                r"eos_token_id must be an int in \[0, 256\), got 9999",
            ),
            ({"eos_token_id": -1}, "eos_token_id .* got -1"),
            ({"num_threads": 0}, "num_threads .* got 0"),
            (
                {"num_threads": MAX_NUM_THREADS + 1},
                rf"num_threads must be in \[1, {MAX_NUM_THREADS}\], got",
            ),
            (
                {"disable_cuda_graph": "yes"},
                "disable_cuda_graph must be a bool, got 'yes'",
            ),
            ({"mem_fraction_static": 0}, r"mem_fraction_static .* \(0, 1\], got 0"),
            ({"mem_fraction_static": 1.5}, "mem_fraction_static .* got 1.5"),
            ({"dist_timeout": 0}, "dist_timeout .* got 0"),
            ({"dist_timeout": float("inf")}, "dist_timeout .* got inf"),
            ({"dist_timeout": 10**400}, "dist_timeout .* got 1000"),  # past float
            ({"dist_timeout": "5"}, "dist_timeout .* got '5'"),
            (
                {"speculative_algorithm": "dspark"},
                "speculative_algorithm must be one of",
            ),
            ({"enable_dp_attention": 1}, "enable_dp_attention must be a bool"),
            ({"dp_size": 0}, "dp_size must be an int >= 1, got 0"),
            ({"enable_dp_attention": True}, "enable_dp_attention needs dp_size > 1"),
            ({"dp_size": 2}, "dp_size=2 without enable_dp_attention"),
            ({"moe_a2a_backend": "deepep"}, "moe_a2a_backend must be one of"),
            (
                {"moe_a2a_backend": "all_to_all"},
                "moe_a2a_backend='all_to_all' .* needs enable_dp_attention",
            ),
        ]
        for kwargs, needle in cases:
            with self.subTest(**{k: repr(v) for k, v in kwargs.items()}):
                with self.assertRaisesRegex(ValueError, needle):
                    ServerArgs(**kwargs)

    def test_cuda_without_a_gpu_says_so(self):
        if cuda_available():
            self.skipTest("a GPU is present: device='cuda' is valid here")
        for device in ("cuda", torch.device("cuda:0")):
            with self.subTest(device=device):
                with self.assertRaisesRegex(ValueError, "no CUDA GPU is available"):
                    ServerArgs(device=device)

    def test_accepted_forms_are_normalized(self):
        args = ServerArgs(
            device=torch.device("cpu"),
            random_seed=np.int64(7),
            max_running_requests=np.int32(4),
            cuda_graph_bs=(4, 1, 2, 2),
            eos_token_id=np.uint8(3),
            dist_timeout=np.float32(2.5),
        )
        self.assertEqual(args.device, "cpu")
        self.assertEqual(ServerArgs(device="cpu:3").device, "cpu")
        # More threads than cores oversubscribe, but run: accepted.
        more = (os.cpu_count() or 1) + 1
        self.assertEqual(ServerArgs(num_threads=more).num_threads, more)
        self.assertEqual((args.random_seed, type(args.random_seed)), (7, int))
        self.assertEqual(type(args.max_running_requests), int)
        self.assertEqual(args.cuda_graph_bs, [1, 2, 4])
        self.assertEqual((args.eos_token_id, type(args.eos_token_id)), (3, int))
        self.assertEqual((args.dist_timeout, type(args.dist_timeout)), (2.5, float))
        engine = Engine(device=torch.device("cpu"), random_seed=np.int64(7))
        out = engine.generate(
            input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 3}
        )
        self.assertEqual(len(out[0]["output_ids"]), 3)

    def test_cuda_graph_bs_default(self):
        # Without graphs no buckets (batches run as given); asked for, kept.
        self.assertIsNone(ServerArgs(device="cpu").cuda_graph_bs)
        self.assertIsNone(
            ServerArgs(device="cpu", disable_cuda_graph=True).cuda_graph_bs
        )
        self.assertEqual(ServerArgs(device="cpu", cuda_graph_bs=[2]).cuda_graph_bs, [2])

    @unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
    def test_cuda_graph_bs_default_on_cuda(self):
        # With graphs on CUDA: powers of two up to the running requests.
        args = ServerArgs(device="cuda", max_running_requests=8)
        self.assertEqual(args.cuda_graph_bs, [1, 2, 4, 8])

    def test_options_the_algorithm_ignores_are_refused(self):
        for kwargs in (
            {"speculative_num_draft_tokens": 6},
            {"speculative_draft_model_path": "anything"},
        ):
            with self.subTest(**kwargs):
                with self.assertRaisesRegex(
                    ValueError, "only used with speculative_algorithm='DSPARK'"
                ):
                    ServerArgs(**kwargs)
        with self.assertRaisesRegex(
            ValueError, "speculative_draft_model_path must be a str"
        ):
            ServerArgs(speculative_algorithm="DSPARK", speculative_draft_model_path=3)

    @unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
    def test_dp_attention_refuses_cuda_graphs(self):
        # Its MoE reads every rank's counts on the host each step.
        kw = dict(device="cuda", enable_dp_attention=True, dp_size=2)
        with self.assertRaisesRegex(ValueError, "pass disable_cuda_graph=True"):
            ServerArgs(**kw)
        self.assertFalse(ServerArgs(disable_cuda_graph=True, **kw).use_cuda_graph)

    def test_a_destroyed_worlds_layout_is_forgotten(self):
        # What init_parallel_from_distributed recorded for a world that has
        # since been destroyed: an engine on one process starts from one.
        get_parallel().override_permanently(moe_ep_size=2, moe_ep_rank=1)
        engine = Engine(device="cpu", random_seed=0)
        self.assertEqual(get_parallel().moe_ep_size, 1)
        out = engine.generate(
            input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 3}
        )
        self.assertEqual(len(out[0]["output_ids"]), 3)

    def test_numpy_verify_width_is_accepted(self):
        args = ServerArgs(
            speculative_algorithm="DSPARK", speculative_num_draft_tokens=np.int64(6)
        )
        self.assertEqual(
            (
                args.speculative_num_draft_tokens,
                type(args.speculative_num_draft_tokens),
            ),
            (6, int),
        )

    def test_dspark_sizes_fit_the_smallest_request(self):
        # The smallest request holds its token and gamma verify slots past
        # it: sizes below that are refused, naming the field. At them it
        # runs: one token (prefill's); one slot more, a second from a decode
        # step whose full verify window fills the pool. Each is plain's.
        width = ServerArgs(speculative_algorithm="DSPARK").speculative_num_draft_tokens
        for name in ("context_length", "max_total_tokens"):
            kw = dict(context_length=width, max_total_tokens=width)
            kw[name] = width - 1
            with (
                self.subTest(name=name),
                self.assertRaisesRegex(
                    ValueError,
                    f"^{name}={width - 1} fits no request: .* needs {width} ",
                ),
            ):
                ServerArgs(speculative_algorithm="DSPARK", max_running_requests=1, **kw)
        for more in (0, 1):
            outputs = []
            for algo, size in ((None, 2 + more), ("DSPARK", width + more)):
                spec = {"speculative_verify_budget": "off"} if algo else {}
                engine = Engine(
                    speculative_algorithm=algo,
                    context_length=size,
                    max_total_tokens=size,
                    max_running_requests=1,
                    device="cpu",
                    **spec,
                )
                out = engine.generate(
                    input_ids=[[3]], sampling_params={"max_new_tokens": 1 + more}
                )
                outputs.append(out[0]["output_ids"])
            with self.subTest(more=more):
                self.assertEqual(len(outputs[0]), 1 + more)
                self.assertEqual(outputs[0], outputs[1])

    def test_cost_table_path(self):
        # Refused before the start-up measurement runs: empty, not a str, a
        # folder, or a new file in a folder that does not exist or that it
        # cannot be written to.
        with tempfile.TemporaryDirectory() as d:
            folder = os.path.realpath(d)
            access = os.access

            def read_only(path, mode):  # the folder as a non-root user sees it
                return False if path == folder else access(path, mode)

            with (
                self.subTest(path="read-only folder"),
                mock.patch("os.access", read_only),
                self.assertRaisesRegex(ValueError, "is not writable to save it in"),
            ):
                ServerArgs(
                    speculative_algorithm="DSPARK",
                    speculative_dspark_sps_table_path=os.path.join(folder, "t.json"),
                )
        for bad, needle in (
            ("", "non-empty str"),
            (3, "non-empty str"),
            (tempfile.gettempdir(), "is a folder; name the table's file"),
            ("/nonexistent/dir/table.json", "does not exist to save it in"),
        ):
            with self.subTest(path=bad):
                with self.assertRaisesRegex(ValueError, needle):
                    ServerArgs(
                        speculative_algorithm="DSPARK",
                        speculative_dspark_sps_table_path=bad,
                    )
        with self.assertRaisesRegex(ValueError, "which would ignore it"):
            ServerArgs(
                speculative_algorithm="DSPARK",
                speculative_verify_budget="off",
                speculative_dspark_sps_table_path="table.json",
            )
        with tempfile.TemporaryDirectory() as d:
            kw = dict(
                speculative_algorithm="DSPARK",
                device="cpu",
                speculative_dspark_sps_table_path=os.path.join(d, "table.json"),
            )
            Engine(**kw)  # measured, then saved there
            path = kw["speculative_dspark_sps_table_path"]
            table = VerifyCostTable.load(path)
            self.assertEqual(Engine(**kw).worker.planner.cost_table, table)  # read
            # Another engine's table (here: another running cap, or a context
            # too short for the 128 keys it was measured at) is refused.
            with self.assertRaisesRegex(ValueError, "another configuration"):
                Engine(max_running_requests=3, **kw)
            with self.assertRaisesRegex(ValueError, "another configuration"):
                Engine(context_length=64, **kw)
            Engine(context_length=256, **kw)  # the same 128 keys: read
            self.assertEqual(os.listdir(d), ["table.json"])  # no temporary left

    def test_dp_attention_without_its_ranks_says_how_to_launch(self):
        # One process, not started by torchrun: no world to join.
        with mock.patch.dict(os.environ):
            os.environ.pop("WORLD_SIZE", None)
            with self.assertRaisesRegex(ValueError, "torchrun --nproc-per-node 2"):
                Engine(enable_dp_attention=True, dp_size=2, device="cpu")

    def test_unknown_engine_argument(self):
        with self.assertRaisesRegex(
            ValueError, r"unknown engine argument\(s\) \['top_q'\]"
        ):
            Engine(top_q=1)


class TestMemorySizing(CustomTestCase):
    def test_estimate_equals_what_the_engine_allocates(self):
        for algo in (None, "DSPARK"):
            with self.subTest(algo=algo):
                kw = dict(
                    max_total_tokens=300, max_running_requests=3, context_length=40
                )
                engine = Engine(speculative_algorithm=algo, device="cpu", **kw)
                pools = (
                    [engine.worker.model_runner.token_to_kv_pool]
                    if algo is None
                    else [
                        engine.worker.target_worker.model_runner.token_to_kv_pool,
                        engine.worker.draft_runner.token_to_kv_pool,
                    ]
                )
                allocated = {
                    "kv_pools": sum(p.k.nbytes + p.v.nbytes for p in pools),
                    "req_to_token": engine.req_to_token_pool.req_to_token.nbytes,
                }
                if algo is not None:  # the verify budget's stash of plain steps
                    stash = engine.worker.context_stash
                    allocated["draft_context_stash"] = stash.nbytes
                allocated["step_buffers"] = engine.worker.buffers.nbytes()
                # The weights, and the MoE's dense layouts (made at the first
                # forward): every storage the models hold, once.
                engine.generate(input_ids=[[1, 2]], sampling_params={})
                worker = engine.worker
                if algo is None:
                    models = [worker.model]
                else:
                    models = [worker.target_worker.model, worker.draft_model]
                held = {}
                for model in models:
                    tensors = list(model.parameters()) + list(model.buffers())
                    for layer in model.modules():
                        if isinstance(layer, EPMoE):
                            self.assertEqual(len(layer._all_experts), 2)
                            tensors += layer._all_experts
                    for t in tensors:
                        held[t.untyped_storage().data_ptr()] = t.untyped_storage()
                allocated["weights"] = sum(st.nbytes() for st in held.values())
                estimate = engine.server_args.static_memory_bytes()
                self.assertEqual(estimate, allocated)

    def test_arena_bytes_are_what_its_constructor_leaves_allocated(self):
        # Every tensor made while an arena is built and still alive after
        # it, each storage once: what nbytes() must find through its
        # attributes (a buffer it missed would make the estimate short).
        runner = ModelRunner(
            forward=None, req_to_token_pool=None, token_to_kv_pool=None, device="cpu"
        )
        builds = {
            "plain": lambda: DecodeBuffers(
                max_batch_size=3, vocab_size=256, model_runner=runner
            ),
            "dspark": lambda: DSparkStepBuffers(
                max_batch_size=3,
                gamma=5,
                vocab_size=256,
                markov_rank=16,
                mask_token_id=1,
                target_runner=runner,
                draft_runner=runner,
                query_shape=(4, 16),
            ),
        }
        for name, build in builds.items():
            with self.subTest(name), _MadeTensors() as made:
                arena = build()
            live = {}
            for ref in made.refs:
                t = ref()
                if t is not None:
                    live[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            self.assertGreater(len(live), 10)
            self.assertEqual(arena.nbytes(), sum(live.values()))
        # DSpark's arena grows as max_running_requests x vocab (its per-slot
        # logits, noise and acceptance): at 64 requests, 58 floats each.
        args = ServerArgs(speculative_algorithm="DSPARK", max_running_requests=64)
        vocab = args._resolve_model().vocab_size
        per_cell = args.static_memory_bytes()["step_buffers"] / (64 * vocab * 4)
        self.assertTrue(58 <= per_cell < 59, per_cell)

    def test_a_config_that_cannot_fit_is_refused_before_allocating(self):
        # 2**40 KV slots need petabytes: refused by the up-front estimate.
        with self.assertRaisesRegex(
            ValueError, r"the pools need .* GiB .*mem_fraction_static=0.5"
        ):
            ServerArgs(max_total_tokens=2**40)
        with self.assertRaisesRegex(ValueError, "req_to_token"):
            ServerArgs(
                max_running_requests=2**36, max_total_tokens=2**36, cuda_graph_bs=[1]
            )
        # Sizes whose step buffers would overflow int64 even on the meta
        # device: refused by the pools' arithmetic first, as a ValueError.
        for algo in (None, "DSPARK"):
            for n in (2**50, 2**56, 2**63, 10**30):
                with self.subTest(algo=algo, n=n):
                    with self.assertRaisesRegex(ValueError, "the pools need"):
                        ServerArgs(
                            speculative_algorithm=algo,
                            max_running_requests=n,
                            max_total_tokens=n,
                            cuda_graph_bs=[1],
                        )
                    with self.assertRaisesRegex(
                        ValueError,
                        f"max_running_requests={n} exceeds max_total_tokens=512",
                    ):
                        ServerArgs(
                            speculative_algorithm=algo,
                            max_running_requests=n,
                            max_total_tokens=512,
                            cuda_graph_bs=[1],
                        )
        # Any config is refused under a small enough cap; the default fits
        # the default cap.
        with self.assertRaisesRegex(ValueError, "mem_fraction_static=1e-12"):
            ServerArgs(mem_fraction_static=1e-12)
        # Pools of a few KiB under a cap of about 2 MB: the weights (5 MB)
        # alone are past it, which no smaller pool mends.
        fraction = 2e6 / available_memory_bytes(torch.device("cpu"))
        with self.assertRaisesRegex(ValueError, "weights alone exceed it"):
            ServerArgs(
                device="cpu",  # the cap is a fraction of the device's memory
                mem_fraction_static=fraction,
                max_total_tokens=8,
                max_running_requests=1,
                context_length=8,
            )
        ServerArgs()


class _MadeTensors(TorchDispatchMode):
    """Weak references to every tensor an op makes inside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.refs.append(weakref.ref(t))
        return out


if __name__ == "__main__":
    unittest.main()
