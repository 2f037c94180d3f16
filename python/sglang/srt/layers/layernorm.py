import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]. One call into torch's composite (on the CPU the same
        # ops as x * rsqrt(mean(x^2) + eps) * weight), less Python per norm.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
