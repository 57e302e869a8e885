"""Optimizer, learning-rate schedule and the guarded optimizer step (drafter ranks).

AdamW over the FSDP2-sharded fp32 parameters (each rank holds its shard's moments). The schedule is a
pure function of the step: linear warmup over a fixed number of steps, then cosine to the run's
current total. A resumed run keeps the warmup length it started with (stored in the checkpoint) and
follows the new total from the resumed step, so extending a run (a larger --max-steps or more
--epochs) never repeats the warmup and never jumps through lr 0.
"""

from __future__ import annotations

import math

import torch


def warmup_steps(ratio: float, total_steps: int) -> int:
    return max(1, int(ratio * total_steps)) if ratio > 0 else 0


def lr_at(step: int, base_lr: float, warmup: int, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based)."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    prog = (step - warmup) / max(1, total_steps - warmup)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, prog)))


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), fused=True)


def guarded_step(model: torch.nn.Module, opt: torch.optim.Optimizer, lr: float, clip: float,
                 loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip by the global (sharded) gradient norm and step, skipping the update on the GPU when the
    loss or the norm is not finite (fused AdamW's found_inf: parameters, moments and step count stay).
    `loss` must be the same on every drafter rank (all-reduced). Returns (grad norm, skipped), both
    device tensors; nothing here waits for the GPU."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False, foreach=True)
    full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    bad = (~torch.isfinite(full)) | (~torch.isfinite(loss))
    torch.nn.utils.clip_grads_with_norm_(grads, clip, norm, foreach=True)
    for g in opt.param_groups:
        g["lr"] = lr
    opt.found_inf = bad.float().to(full.device)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return full, bad
