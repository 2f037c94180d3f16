import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]. In place on the [T, 1] statistic: same ops, fewer
        # allocations.
        scale = x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return x * scale * self.weight
