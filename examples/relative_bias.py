"""An example encoding in one file: a learned bias per head and clipped relative distance.

    A_ij = softmax_j( q_i . k_j / sqrt(D) + b_h[clip(i - j, -K, K)] )      (K: option relbias_clip)

It is the template for a new encoding (README, "Add your own encoding"): an attention layer with
the shared interface `__init__(cfg)` / `forward(x, ctx)`, a `Method` naming it and its options,
and one line in train.METHODS. The generic tests in tests/test_methods.py then cover it.

    python train.py --method relbias --task copy
    python train.py --method relbias --task copy --method-opt relbias_clip=4 --tag clip4

Shapes: B batch, T time, C d_model, H heads, D head dim.
"""
import torch
import torch.nn as nn

from model import Method, Opt, attend, relative_distance


class RelativeBiasAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, H = cfg.d_model, cfg.n_heads
        self.H, self.D, self.causal = H, C // H, cfg.causal
        self.K = int(cfg.opts.get("relbias_clip", 32))
        if self.K < 1:
            raise ValueError(f"relbias_clip must be at least 1, got {self.K}")
        self.qkv = nn.Linear(C, 3 * C, bias=False)
        self.out = nn.Linear(C, C, bias=False)
        self.bias = nn.Parameter(torch.zeros(H, 2 * self.K + 1))     # b_h[d + K] for d in [-K, K]

    def forward(self, x, ctx):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.H, self.D).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D)
        rel = relative_distance(T, x.device).clamp(-self.K, self.K) + self.K       # (T, T) in [0, 2K]
        o = attend(q, k, v, self.causal, self.bias[:, rel], ctx.get("key_mask"))   # bias: (H, T, T)
        return self.out(o.transpose(1, 2).reshape(B, T, C))                       # (B, T, C)


RELBIAS = Method(RelativeBiasAttention, options={"relbias_clip": Opt(int, "clip distance K (default 32)", 1)})
