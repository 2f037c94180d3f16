"""ServerArgs: the engine's arguments, validated and resolved once.

Every field is type- and range-checked here, before anything is allocated;
a bad value is a ValueError naming the field and the value. numpy integer
and float scalars are accepted and stored as Python numbers. The memory the
KV pools, the request table, the step buffers and the weights will take is
computed up front, and a configuration that needs more than
``mem_fraction_static`` of the memory available on the device now is
rejected before any of it is allocated.
"""

import argparse
import itertools
import numbers
import os
from dataclasses import dataclass
from typing import List, Optional, Union

import numpy as np
import torch

from sglang.srt.arg_groups.speculative_hook import _handle_dspark
from sglang.srt.layers.moe.ep_moe import EPMoE
from sglang.srt.managers.schedule_batch import kv_slots_needed
from sglang.srt.managers.tp_worker import DecodeBuffers
from sglang.srt.mem_cache.memory_pool import (
    KVPool,
    ReqToTokenPool,
    available_memory_bytes,
)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.models.dspark import DSparkDraftModel
from sglang.srt.models.registry import (
    DEFAULT_MODEL_PATH,
    get_draft_config,
    get_target_preset,
)
from sglang.srt.models.tiny_moe import TinyMoEConfig, TinyMoEForCausalLM
from sglang.srt.runtime_context import MOE_A2A_BACKENDS, get_parallel
from sglang.srt.speculative.dspark_components.dspark_buffers import DSparkStepBuffers
from sglang.srt.speculative.dspark_components.dspark_config import DSparkConfig
from sglang.srt.utils.common import SEED_BOUND, checked_num_threads, is_finite

SPECULATIVE_ALGORITHMS = (None, "DSPARK")
KV_CACHE_DTYPE = torch.float32
_GIB = 1 << 30


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(
        value, (bool, np.bool_)
    )


def _checked_int(
    name: str, value, *, lo: int, hi: Optional[int] = None, hi_text: str = ""
) -> int:
    """``value`` as a Python int in [lo, hi), or ValueError naming ``name``."""
    if not _is_int(value) or value < lo or (hi is not None and value >= hi):
        bound = f"in [{lo}, {hi_text or hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")
    return int(value)


def _checked_float(name: str, value, *, lo: float, hi: float, lo_open: bool) -> float:
    """``value`` as a finite float in (lo, hi] or [lo, hi]."""
    ok = (
        isinstance(value, numbers.Real)
        and not isinstance(value, (bool, np.bool_))
        and is_finite(value)
        and (value > lo if lo_open else value >= lo)
        and value <= hi
    )
    if not ok:
        bound = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise ValueError(f"{name} must be a finite number in {bound}, got {value!r}")
    return float(value)


def checked_device(value) -> str:
    """'cpu' or 'cuda[:N]' from a str or torch.device; CUDA must be present."""
    if value is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(value, (str, torch.device)):
        raise ValueError(
            f"device must be a str or torch.device, got {type(value).__name__} "
            f"{value!r}"
        )
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise ValueError(f"device {value!r} is not a device name") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {value!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={value!r} but no CUDA GPU is available "
                f"(torch.cuda.is_available() is False); use device='cpu'"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device={value!r} but only {torch.cuda.device_count()} CUDA "
                f"device(s) exist"
            )
    return "cpu" if device.type == "cpu" else str(device)  # one CPU: no index


def device_arg(text: str) -> str:
    """A command line's ``--device``, as ``ServerArgs`` takes it: its name
    (``cpu:0`` is ``cpu``), or the parser's error."""
    try:
        return checked_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _weights_bytes(target_config: TinyMoEConfig, draft_config) -> int:
    """The target's and the draft's parameters and buffers (the shared
    embedding and LM head once), and each MoE layer's dense layout, at the
    run dtype (float32). Every expert: under EP a rank holds its share, so
    this bounds a rank's from above."""
    with torch.device("meta"), get_parallel().override(moe_ep_size=1, moe_ep_rank=0):
        target = TinyMoEForCausalLM(target_config)
        models = [target]
        if draft_config is not None:
            models.append(DSparkDraftModel(draft_config, target))
    tensors = {}
    for model in models:
        for t in itertools.chain(model.parameters(), model.buffers()):
            tensors[id(t)] = t.nbytes  # a shared module's tensors once
        for layer in model.modules():
            if isinstance(layer, EPMoE):
                tensors[id(layer)] = layer.dense_layout_nbytes()
    return sum(tensors.values())


@dataclass
class ServerArgs:
    model_path: Optional[str] = None  # None: the embedded default pair
    speculative_algorithm: Optional[str] = None  # None or "DSPARK"
    speculative_draft_model_path: Optional[str] = None  # None: the bundled draft
    # The verify width, gamma + 1 (upstream's meaning); None: draft's block + 1.
    speculative_num_draft_tokens: Optional[int] = None
    # Drafted tokens a DSpark step verifies: "auto" (planned per step from
    # the drafts' confidence and a measured cost table; 0 is a plain step),
    # "off" (every draft), or an int: at most that many per step. Under
    # "auto" an unseeded sampled request's tokens follow the timings, so they
    # can differ between runs (a seeded request's cannot).
    speculative_verify_budget: Union[str, int] = "auto"
    # The cost table "auto" plans with: read from this file when it exists,
    # else measured at start-up (and saved here when a path is given).
    speculative_dspark_sps_table_path: Optional[str] = None
    # str or torch.device; None: cuda when present, else cpu. Stored as str.
    device: Optional[Union[str, torch.device]] = None
    random_seed: int = 0  # in [0, 2**63)
    # Padded buckets. None: the default list on CUDA; without CUDA graphs
    # none, so every batch runs as given (padding feeds a graph; with no
    # graph it only adds rows). Given without graphs, batches are padded
    # eagerly as a graph would pad them (tests of the padded path).
    cuda_graph_bs: Optional[List[int]] = None
    disable_cuda_graph: bool = False
    max_running_requests: int = 8
    max_total_tokens: int = 4096  # KV slots
    context_length: int = 512  # per-request positions
    eos_token_id: Optional[int] = None
    # torch intra-op threads for this process; None: 1 on CPU (the slice's ops
    # are tiny and dispatch-bound, so more threads only add sync and
    # oversubscription), torch's default on CUDA (the host only launches).
    num_threads: Optional[int] = None
    # The KV pools, request table, step buffers and weights may take at most
    # this fraction of the memory available on the device when the engine
    # starts (``static_memory_bytes``).
    mem_fraction_static: float = 0.5
    # Seconds any collective (EP all-reduce, rank agreement checks) may wait
    # for a peer before it raises.
    dist_timeout: float = 60.0
    # Data-parallel attention (upstream's names): dp_size ranks, one per
    # process of a torch.distributed world of that size, each decoding its
    # own share of the requests (every rank is given every call's requests
    # and takes those at index rank, rank + dp_size, ...) with its own
    # batch and KV pool; max_running_requests and the pools are per rank.
    # The MoE is expert-parallel over them.
    enable_dp_attention: bool = False
    dp_size: int = 1
    # How MoE rows reach their experts' ranks under DP attention: "none"
    # (gather every rank's rows, all-reduce the shares) or "all_to_all"
    # (each real row only to its experts' ranks; eager only).
    moe_a2a_backend: str = "none"

    def __post_init__(self) -> None:
        target_config = self._resolve_model()
        self._check_speculative()
        self.device = checked_device(self.device)
        self.random_seed = _checked_int(
            "random_seed", self.random_seed, lo=0, hi=SEED_BOUND, hi_text="2**63"
        )
        for name in ("max_running_requests", "max_total_tokens", "context_length"):
            setattr(self, name, _checked_int(name, getattr(self, name), lo=1))
        self._check_smallest_request_fits()
        if self.max_running_requests > self.max_total_tokens:
            raise ValueError(
                f"max_running_requests={self.max_running_requests} exceeds "
                f"max_total_tokens={self.max_total_tokens}: every running request "
                f"holds at least one KV slot"
            )
        if self.num_threads is None and not self.device.startswith("cuda"):
            self.num_threads = 1
        if self.num_threads is not None:
            self.num_threads = checked_num_threads("num_threads", self.num_threads)
        vocab = target_config.vocab_size
        if self.eos_token_id is not None:
            self.eos_token_id = _checked_int(
                "eos_token_id", self.eos_token_id, lo=0, hi=vocab
            )
        if not isinstance(self.disable_cuda_graph, bool):
            raise ValueError(
                f"disable_cuda_graph must be a bool, got {self.disable_cuda_graph!r}"
            )
        self.mem_fraction_static = _checked_float(
            "mem_fraction_static", self.mem_fraction_static, lo=0, hi=1, lo_open=True
        )
        self.dist_timeout = _checked_float(
            "dist_timeout", self.dist_timeout, lo=0, hi=7 * 24 * 3600, lo_open=True
        )
        self._check_dp_attention()
        self._check_cuda_graph_bs()
        max_position = target_config.max_position
        if self.context_length > max_position:
            raise ValueError(
                f"context_length={self.context_length} exceeds the model's "
                f"max_position={max_position}"
            )
        self._check_memory()

    def _check_smallest_request_fits(self) -> None:
        """Refuse sizes no request fits: the smallest, one prompt token and
        one new token, spans 2 positions of context; under DSpark it holds
        1 + gamma KV slots (its token and the verify window past it), within
        the context too."""
        gamma = self.speculative_dspark_block_size or 0
        slots = kv_slots_needed(prompt_len=1, max_new_tokens=1, lookahead=gamma)
        window = ""
        if gamma:
            window = f" (its token and the verify's gamma={gamma} slots past it)"
        for name, need in (
            ("context_length", max(2, slots)),
            ("max_total_tokens", slots),
        ):
            value = getattr(self, name)
            if value < need:
                raise ValueError(
                    f"{name}={value} fits no request: the smallest (one prompt "
                    f"token, one new token) needs {need}{window}"
                )

    def _check_dp_attention(self) -> None:
        if not isinstance(self.enable_dp_attention, bool):
            raise ValueError(
                f"enable_dp_attention must be a bool, got {self.enable_dp_attention!r}"
            )
        self.dp_size = _checked_int("dp_size", self.dp_size, lo=1)
        if self.enable_dp_attention and self.dp_size == 1:
            raise ValueError(
                "enable_dp_attention needs dp_size > 1 (one DP attention rank per "
                "process)"
            )
        if self.dp_size > 1 and not self.enable_dp_attention:
            raise ValueError(
                f"dp_size={self.dp_size} without enable_dp_attention: this slice "
                f"has no data-parallel controller over independent replicas; "
                f"pass enable_dp_attention=True"
            )
        if self.moe_a2a_backend not in MOE_A2A_BACKENDS:
            raise ValueError(
                f"moe_a2a_backend must be one of {MOE_A2A_BACKENDS}, got "
                f"{self.moe_a2a_backend!r}"
            )
        if self.moe_a2a_backend != "none" and not self.enable_dp_attention:
            raise ValueError(
                f"moe_a2a_backend={self.moe_a2a_backend!r} dispatches each "
                f"rank's own rows: it needs enable_dp_attention=True"
            )
        if self.enable_dp_attention and self.use_cuda_graph:
            # Each step's MoE needs every rank's row counts, set per step on
            # the host (and the all-to-all reads its send splits there): a
            # graph captured at start-up has neither.
            raise ValueError(
                "enable_dp_attention runs its steps eagerly in this slice: its "
                "MoE reads every rank's row counts on the host each step, which "
                "a CUDA graph cannot; pass disable_cuda_graph=True"
            )

    def _resolve_model(self) -> TinyMoEConfig:
        """The one place a model path becomes a config."""
        if self.model_path is None:
            self.model_path = DEFAULT_MODEL_PATH
        if not isinstance(self.model_path, str):
            raise ValueError(f"model_path must be a str, got {self.model_path!r}")
        return get_target_preset(self.model_path).config

    def _check_speculative(self) -> None:
        algo = self.speculative_algorithm
        if algo not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, "
                f"got {algo!r}"
            )
        path = self.speculative_draft_model_path
        if path is not None and not isinstance(path, str):
            raise ValueError(
                f"speculative_draft_model_path must be a str, got {path!r}"
            )
        budget = self.speculative_verify_budget
        if budget not in ("auto", "off") and (not _is_int(budget) or budget < 0):
            raise ValueError(
                f"speculative_verify_budget must be 'auto', 'off' or an int >= 0, "
                f"got {budget!r}"
            )
        if _is_int(budget):
            self.speculative_verify_budget = int(budget)
        table = self.speculative_dspark_sps_table_path
        if table is not None and (not isinstance(table, str) or not table):
            raise ValueError(
                f"speculative_dspark_sps_table_path must be a non-empty str, got "
                f"{table!r}"
            )
        if table is not None and self.speculative_verify_budget != "auto":
            raise ValueError(
                f"speculative_dspark_sps_table_path is the cost table "
                f"speculative_verify_budget='auto' plans with; got budget "
                f"{self.speculative_verify_budget!r}, which would ignore it"
            )
        if table is not None and os.path.isdir(table):
            raise ValueError(
                f"speculative_dspark_sps_table_path {table!r} is a folder; name "
                f"the table's file"
            )
        if table is not None and not os.path.exists(table):
            # Measured at start-up and saved there: its folder must exist and
            # take the file, checked before the measurement runs.
            folder = os.path.dirname(os.path.abspath(table))
            if not os.path.isdir(folder):
                raise ValueError(
                    f"speculative_dspark_sps_table_path {table!r}: no such file, "
                    f"and its folder {folder!r} does not exist to save it in"
                )
            if not os.access(folder, os.W_OK | os.X_OK):
                raise ValueError(
                    f"speculative_dspark_sps_table_path {table!r}: no such file, "
                    f"and its folder {folder!r} is not writable to save it in"
                )
        if algo is None:
            # Options plain decoding would ignore: refuse them rather than drop.
            for name, unset in (
                ("speculative_draft_model_path", None),
                ("speculative_num_draft_tokens", None),
                ("speculative_verify_budget", "auto"),
                ("speculative_dspark_sps_table_path", None),
            ):
                if getattr(self, name) != unset:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} is only used with "
                        f"speculative_algorithm='DSPARK', got speculative_algorithm="
                        f"None"
                    )
            return
        _handle_dspark(self)

    def _check_cuda_graph_bs(self) -> None:
        bs = self.cuda_graph_bs
        if bs is None:
            if not self.use_cuda_graph:
                return
            self.cuda_graph_bs = [
                b for b in (1, 2, 4, 8, 16, 32) if b < self.max_running_requests
            ] + [self.max_running_requests]
            return
        if (
            not isinstance(bs, (list, tuple))
            or not bs
            or not all(_is_int(b) and 1 <= b <= self.max_running_requests for b in bs)
        ):
            raise ValueError(
                f"cuda_graph_bs must be a non-empty list of ints in [1, "
                f"max_running_requests={self.max_running_requests}], got {bs!r}"
            )
        self.cuda_graph_bs = sorted({int(b) for b in bs})

    def static_memory_bytes(self) -> dict:
        """Bytes the engine's pools, buffers and weights will take: target
        and draft KV, the request -> token table, the decode step's buffer
        arena (for DSpark about 58 x max_running_requests x vocab floats: its
        per-slot logits, noise and acceptance), and the models' weights with
        the MoE's dense layouts, all built on the meta device."""
        target_config = self._resolve_model()
        draft_config, stash = None, 0
        meta = ModelRunner(
            forward=None,
            req_to_token_pool=None,
            token_to_kv_pool=None,
            device=torch.device("meta"),
        )
        if self.speculative_algorithm == "DSPARK":
            draft_config = get_draft_config(self.speculative_draft_model_path)
            config = DSparkConfig.from_models(
                draft=draft_config,
                target=target_config,
                gamma=self.speculative_dspark_block_size,
            )
            arena = DSparkStepBuffers(
                max_batch_size=self.max_running_requests,
                gamma=config.gamma,
                vocab_size=config.vocab_size,
                markov_rank=config.markov_rank,
                mask_token_id=config.mask_token_id,
                target_runner=meta,
                draft_runner=meta,
                query_shape=(target_config.num_heads, target_config.head_dim),
            )
            if self.speculative_verify_budget != "off":
                # The target hidden states of plain steps, per KV slot.
                width = len(config.target_layer_ids)
                stash = (
                    (self.max_total_tokens + 1) * width * target_config.hidden_size * 4
                )
        else:
            arena = DecodeBuffers(
                max_batch_size=self.max_running_requests,
                vocab_size=target_config.vocab_size,
                model_runner=meta,
            )
        sizes = self._pool_bytes()
        if stash:
            sizes["draft_context_stash"] = stash
        sizes["step_buffers"] = arena.nbytes()
        sizes["weights"] = _weights_bytes(target_config, draft_config)
        return sizes

    def _pool_bytes(self) -> dict:
        """The KV pools' and the request table's bytes: arithmetic, any size."""
        target_config = self._resolve_model()
        num_layers = target_config.num_layers
        if self.speculative_algorithm == "DSPARK":
            num_layers += get_draft_config(self.speculative_draft_model_path).num_layers
        return {
            "kv_pools": KVPool.nbytes_for(
                num_layers=num_layers,
                num_slots=self.max_total_tokens,
                num_heads=target_config.num_heads,
                head_dim=target_config.head_dim,
                dtype=KV_CACHE_DTYPE,
            ),
            "req_to_token": ReqToTokenPool.nbytes_for(
                max_reqs=self.max_running_requests,
                max_context_len=self.context_length,
            ),
        }

    def _check_memory(self) -> None:
        available = available_memory_bytes(torch.device(self.device))
        cap = int(self.mem_fraction_static * available)
        # The pools first: sizes past memory fail here, before the step
        # buffers are laid out (on the meta device, whose sizes overflow
        # int64 far past any memory).
        self._check_fits(self._pool_bytes(), available, cap)
        self._check_fits(self.static_memory_bytes(), available, cap)

    def _check_fits(self, need: dict, available: int, cap: int) -> None:
        total = sum(need.values())
        if total > cap:
            parts = ", ".join(f"{k} {v / _GIB:.3f} GiB" for k, v in need.items())
            advice = "lower max_total_tokens, max_running_requests or context_length"
            if need.get("weights", 0) > cap:  # no size of the pools fits
                advice = "the weights alone exceed it: raise mem_fraction_static"
            raise ValueError(
                f"the pools need {total / _GIB:.3f} GiB ({parts}) but "
                f"mem_fraction_static={self.mem_fraction_static} of the "
                f"{available / _GIB:.3f} GiB available on {self.device} is "
                f"{cap / _GIB:.3f} GiB: {advice}"
            )

    @property
    def speculative_dspark_block_size(self) -> Optional[int]:
        """gamma: the draft block, one less than the verify width; None
        without speculation."""
        if self.speculative_num_draft_tokens is None:
            return None
        return self.speculative_num_draft_tokens - 1

    @property
    def use_cuda_graph(self) -> bool:
        return self.device.startswith("cuda") and not self.disable_cuda_graph
