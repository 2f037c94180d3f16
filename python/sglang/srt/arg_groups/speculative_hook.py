"""Speculative-decoding argument resolution, where upstream keeps it.

``_handle_dspark(server_args)`` runs once from ``ServerArgs.__post_init__``
when ``speculative_algorithm == "DSPARK"``:

- a target checkpoint whose config bundles a DSpark draft (all of
  ``dspark_block_size``, ``dspark_markov_rank``, ``dspark_target_layer_ids``,
  ``dspark_noise_token_id``) defaults the draft path to the model path;
- a plain target with no draft path is a ValueError; an explicit path is kept;
- ``speculative_num_draft_tokens`` is the target's verify width, the draft's
  block size + 1 (a block of 5 gives 6); a value the draft cannot run is a
  ValueError naming both numbers.
"""

import numbers
from types import SimpleNamespace

import numpy as np

DSPARK_CONFIG_FIELDS = (
    "dspark_block_size",
    "dspark_markov_rank",
    "dspark_target_layer_ids",
    "dspark_noise_token_id",
)


def _hf_config(server_args) -> SimpleNamespace:
    model_config = getattr(server_args, "_model_config", None)
    if model_config is None:
        from sglang.srt.models.registry import get_hf_config

        model_config = SimpleNamespace(hf_config=get_hf_config(server_args.model_path))
        server_args._model_config = model_config
    return model_config.hf_config


def _bundles_dspark_draft(hf_config) -> bool:
    return all(getattr(hf_config, f, None) is not None for f in DSPARK_CONFIG_FIELDS)


def _target_checkpoint_bundles_dspark_draft(server_args) -> bool:
    """True when the target's own config carries a DSpark draft."""
    return _bundles_dspark_draft(_hf_config(server_args))


def _draft_block_size(server_args) -> int:
    if server_args.speculative_draft_model_path == server_args.model_path:
        hf_config = _hf_config(server_args)
    else:
        from sglang.srt.models.registry import get_hf_config

        hf_config = get_hf_config(server_args.speculative_draft_model_path)
    if not _bundles_dspark_draft(hf_config):
        raise ValueError(
            f"speculative_draft_model_path={server_args.speculative_draft_model_path!r}"
            f" is not a DSpark draft: its config lacks "
            f"{[f for f in DSPARK_CONFIG_FIELDS if getattr(hf_config, f, None) is None]}"
        )
    return hf_config.dspark_block_size


def _handle_dspark(server_args) -> None:
    if server_args.speculative_draft_model_path is None:
        if not _target_checkpoint_bundles_dspark_draft(server_args):
            raise ValueError(
                f"model {server_args.model_path!r} bundles no DSpark draft (its "
                f"config has no {', '.join(DSPARK_CONFIG_FIELDS)}); pass "
                "speculative_draft_model_path"
            )
        server_args.speculative_draft_model_path = server_args.model_path
    block_size = _draft_block_size(server_args)
    width = server_args.speculative_num_draft_tokens
    if width is None:
        server_args.speculative_num_draft_tokens = block_size + 1
        return
    if (
        isinstance(width, (bool, np.bool_))
        or not isinstance(width, numbers.Integral)
        or width < 2
    ):
        raise ValueError(
            f"speculative_num_draft_tokens (the verify width, block size + 1) must "
            f"be an int >= 2, got {width!r}"
        )
    server_args.speculative_num_draft_tokens = width = int(width)
    if width != block_size + 1:
        raise ValueError(
            f"speculative_num_draft_tokens={width} does not fit the draft "
            f"{server_args.speculative_draft_model_path!r}: its block size is "
            f"{block_size}, so the verify width must be {block_size + 1}"
        )
