"""InternLM's learning-rate (linear warm-up, then cosine to eta_min), the warm-up / stable / decay (WSD) one, and
the beta2 schedule, all Stateful. Each learning rate is a pure function of the step and the config: a resumed run
that changes the config (the WSD decay start, the peak lr) follows its new schedule from the step it resumes at."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..errors import ConfigError
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


# the WSD decay's shapes: the fraction of (lr - eta_min) left at progress p in [0, 1] of the decay
DECAY_SHAPES = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: (1.0 + math.cos(math.pi * p)) / 2,
    "1-sqrt": lambda p: 1.0 - math.sqrt(p),
}


class WarmupStableDecayLR(WarmupCosineLR):
    """Warm-up, stable, decay (WSD; MiniCPM, DeepSeek-V3, "Scaling Laws and Compute-Optimal Training Beyond Fixed
    Training Durations"): the same linear warm-up as WarmupCosineLR for t < W, then the peak lr until the decay
    start D, then down to eta_min at t = T along `decay_shape` (linear 1-p, cosine (1+cos(pi p))/2, 1-sqrt
    1-sqrt(p), with p = (t-D)/(T-D)), eta_min after T.

    D = `decay_start_step`, or T - int(T * decay_ratio) when that is None. The state (the step and the peak lrs)
    is WarmupCosineLR's, so either schedule resumes the other's checkpoint; D is read from this run's config, so a
    job resumed with another lr_scheduler.decay_start_step (e.g. to cool down now, or later than planned) decays
    from that step on. Resumed past the new D, the lr continues from the decay's value at the resumed step (a jump
    the log names)."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float, eta_min: float,
                 init_steps: int = 0, decay_start_step: Optional[int] = None, decay_ratio: float = 0.1,
                 decay_shape: str = "1-sqrt"):
        if decay_shape not in DECAY_SHAPES:
            raise ConfigError(f"lr_scheduler.decay_shape: expected one of {', '.join(DECAY_SHAPES)}, "
                              f"got {decay_shape!r}")
        warmup = int(total_steps * warmup_ratio)
        start = total_steps - int(total_steps * decay_ratio) if decay_start_step is None else int(decay_start_step)
        if not warmup <= start <= total_steps:
            key = "decay_ratio" if decay_start_step is None else "decay_start_step"
            raise ConfigError(f"lr_scheduler.{key}: the decay must start between the end of the warm-up (step "
                              f"{warmup}) and lr_scheduler.total_steps ({total_steps}), got step {start}")
        self.decay_start_step, self.decay_shape = start, decay_shape
        self._shape = DECAY_SHAPES[decay_shape]
        super().__init__(optimizer, total_steps, warmup_ratio, eta_min, init_steps)
        logger.info(f"lr schedule: WSD, warm-up to step {warmup}, stable to step {start}, {decay_shape} decay to "
                    f"eta_min {eta_min} at step {total_steps}")

    def lr_at(self, t: int, base_lr: float) -> float:
        if t < self.warmup_steps:
            return base_lr * (t + 1) / self.warmup_steps
        if t < self.decay_start_step:
            return base_lr
        span = max(self.total_steps - self.decay_start_step, 1)
        progress = min(t - self.decay_start_step, span) / span
        return self.eta_min + (base_lr - self.eta_min) * self._shape(progress)

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        if self.last_step > self.decay_start_step:
            logger.info(f"lr schedule: resumed at step {self.last_step}, in the decay that starts at step "
                        f"{self.decay_start_step}: lr {self.get_last_lr()[0]:.6g}")


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
