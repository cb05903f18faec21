"""AdamW with its two moments stored in bfloat16 (Table 5: "Adam state BF16"), half of float32 AdamW's state.

At 32B the float32 moments are 61 GiB per rank over 4 FSDP ranks; in bfloat16 they are 30.5 GiB. Each step reads a
parameter's moments into float32, applies the AdamW update exactly as ``torch.optim.AdamW`` does (decoupled weight
decay, bias corrections, ε outside the square root) to the float32 master weights, and rounds the new moments back to
bfloat16 (round to nearest even). Only the stored moments lose precision: the update of step t uses moments carried
with 8 bits of mantissa, a relative perturbation below 2⁻⁸ of each moment, far below the AdamW step's own variation.
The parameters, gradients and the update itself stay in the master weights' dtype.

Works elementwise on any parameters, FSDP2's DTensor shards and DeepSpeed's partitions included; the float32
temporaries are one parameter's (shard's) worth at a time.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class CompactAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW``'s update with moments kept in ``state_dtype``.

    Args:
        params: Parameters (or parameter groups) to optimize.
        lr, betas, eps, weight_decay: As ``torch.optim.AdamW``.
        state_dtype: dtype of ``exp_avg`` and ``exp_avg_sq`` (bfloat16: Table 5).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        state_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        state["step"] += 1
        t = float(state["step"])
        grad = p.grad.to(p.dtype)
        exp_avg = state["exp_avg"].to(p.dtype).lerp_(grad, 1 - beta1)  # torch.optim.AdamW's ops, in float32
        exp_avg_sq = state["exp_avg_sq"].to(p.dtype).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        p.mul_(1 - lr * decay)
        bias1, bias2 = 1 - beta1**t, 1 - beta2**t
        denom = (exp_avg_sq.sqrt() / bias2**0.5).add_(eps)
        p.addcdiv_(exp_avg, denom, value=-lr / bias1)
        state["exp_avg"].copy_(exp_avg)  # rounded to state_dtype
        state["exp_avg_sq"].copy_(exp_avg_sq)
