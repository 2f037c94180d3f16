import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]. On CUDA torch's fused kernel. On the CPU torch's
        # composite runs x * rsqrt(mean(x^2) + eps) * weight as five fresh
        # tensors; for float32 (its compute type) the same ops with the
        # rsqrt and the weight applied in place make three, bitwise the same
        # values and gradients. Other dtypes: torch's (it upcasts).
        if x.is_cuda or x.dtype != torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        scale = x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return torch.mul(x, scale).mul_(self.weight)
