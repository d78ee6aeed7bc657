"""InternLM's learning-rate (linear warm-up, then cosine to eta_min) and beta2 schedules, both Stateful."""

from __future__ import annotations

import math

import torch

from ..utils.logging import get_logger

logger = get_logger(__name__)


class WarmupCosineLR:
    """lr(t) = lr * (t+1)/W for t < W, then eta_min + (lr - eta_min) * (1 + cos(pi * (t-W)/(T-W))) / 2.

    W = int(total_steps * warmup_ratio); t counts successful optimizer steps from `init_steps`.
    This is InternLM's FineTuneCosineAnnealingWarmupLR (a WarmupScheduler around CosineAnnealingLR).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float, eta_min: float,
                 init_steps: int = 0):
        self.optimizer = optimizer
        self.total_steps = total_steps
        self.warmup_steps = int(total_steps * warmup_ratio)
        self.eta_min = eta_min
        self.base_lrs = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
        for g, lr in zip(optimizer.param_groups, self.base_lrs):
            g["initial_lr"] = lr
        self.last_step = init_steps
        self._apply()

    def lr_at(self, t: int, base_lr: float) -> float:
        w, total = self.warmup_steps, self.total_steps
        if t < w:
            return base_lr * (t + 1) / w
        span = max(total - w, 1)
        progress = min(t - w, span) / span
        return self.eta_min + (base_lr - self.eta_min) * (1 + math.cos(math.pi * progress)) / 2

    def _apply(self) -> None:
        for g, base in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = self.lr_at(self.last_step, base)

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_step": self.last_step, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, sd: dict) -> None:
        """The schedule's position from `sd`; the peak learning rate stays this run's (adam.lr): a changed one
        replaces the checkpoint's, as InternLM's load_scheduler does (with its warning)."""
        self.last_step = int(sd["last_step"])
        saved = [float(x) for x in sd["base_lrs"]]
        if saved != self.base_lrs:
            logger.warning(f"Using new learning rate {self.base_lrs[0]} to replace old learn rate {saved[0]}.")
        for g, lr in zip(self.optimizer.param_groups, self.base_lrs):
            g["initial_lr"] = lr  # the loaded optimizer state carried the old one
        self._apply()


class Beta2Scheduler:
    """beta2(t) = max(init_beta2, 1 - t**-c) for c > 0, else init_beta2 (InternLM's Beta2Scheduler)."""

    def __init__(self, optimizer: torch.optim.Optimizer, init_beta2: float, c: float, cur_iter: int = -1):
        self.optimizer = optimizer
        self.init_beta2 = init_beta2
        self.c = c
        self.cur_iter = 0 if cur_iter == -1 else cur_iter

    def get_beta2(self) -> float:
        if self.c <= 0 or self.cur_iter <= 0:
            return self.init_beta2
        return max(self.init_beta2, 1.0 - 1.0 / self.cur_iter**self.c)

    def step(self) -> None:
        self.cur_iter += 1
        beta2 = self.get_beta2()
        for g in self.optimizer.param_groups:
            g["betas"] = (g["betas"][0], beta2)

    def state_dict(self) -> dict:
        return {"cur_iter": self.cur_iter}

    def load_state_dict(self, sd: dict) -> None:
        self.cur_iter = int(sd["cur_iter"])
        if self.c > 0:
            beta2 = self.get_beta2()
            for g in self.optimizer.param_groups:
                g["betas"] = (g["betas"][0], beta2)
