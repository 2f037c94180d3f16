"""DSparkConfig: the draft's knobs, validated once against the target."""

from dataclasses import dataclass
from typing import Optional, Tuple

from sglang.srt.models.dspark import DSparkDraftConfig
from sglang.srt.models.tiny_moe import TinyMoEConfig


@dataclass(frozen=True)
class DSparkConfig:
    gamma: int  # tokens proposed per block
    mask_token_id: int
    markov_rank: int
    target_layer_ids: Tuple[int, ...]
    vocab_size: int
    num_target_layers: int

    def __post_init__(self) -> None:
        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.gamma) or self.gamma < 1:
            raise ValueError(f"gamma must be an int >= 1, got {self.gamma!r}")
        if (
            not is_int(self.mask_token_id)
            or not 0 <= self.mask_token_id < self.vocab_size
        ):
            raise ValueError(
                f"mask_token_id must be in [0, vocab_size={self.vocab_size}), "
                f"got {self.mask_token_id!r}"
            )
        if not is_int(self.markov_rank) or self.markov_rank < 1:
            raise ValueError(
                f"markov_rank must be an int >= 1, got {self.markov_rank!r}"
            )
        ids = self.target_layer_ids
        last = self.num_target_layers - 1
        if (
            not ids
            or not all(is_int(i) for i in ids)
            or any(b <= a for a, b in zip(ids, ids[1:]))
            or ids[0] < 0
            or ids[-1] >= last
        ):
            raise ValueError(
                f"target_layer_ids must be non-empty, strictly increasing and in "
                f"[0, {last}) (never the last layer), got {ids!r}"
            )

    @classmethod
    def from_models(
        cls,
        *,
        draft: DSparkDraftConfig,
        target: TinyMoEConfig,
        gamma: Optional[int] = None,
    ) -> "DSparkConfig":
        """Gamma defaults to the block size the draft was trained with."""
        return cls(
            gamma=draft.block_size if gamma is None else gamma,
            mask_token_id=draft.mask_token_id,
            markov_rank=draft.markov_rank,
            target_layer_ids=tuple(draft.target_layer_ids),
            vocab_size=target.vocab_size,
            num_target_layers=target.num_layers,
        )
