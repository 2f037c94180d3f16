"""SGLang-shaped slice of DSpark block speculative decoding (dist: dspark-slice)."""

__all__ = ["Engine"]


def __getattr__(name):
    # Lazy, so that CI tooling under sglang.test imports without torch.
    if name == "Engine":
        from sglang.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module 'sglang' has no attribute {name!r}")
