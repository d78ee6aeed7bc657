"""InternLM's DynamicGradScaler for fp16: loss scaling with hysteresis, min and max scale. Stateful."""

from __future__ import annotations

from ..config.schema import GradScalerConfig


class DynamicGradScaler:
    """Multiply the loss by `scale`; after an overflow in `hysteresis` steps shrink, after
    `growth_interval` clean steps grow (bounded by min_scale/max_scale)."""

    def __init__(self, cfg: GradScalerConfig):
        self.scale = float(cfg.initial_scale)
        self.min_scale, self.max_scale = float(cfg.min_scale), float(cfg.max_scale)
        self.growth_factor, self.backoff_factor = float(cfg.growth_factor), float(cfg.backoff_factor)
        self.growth_interval, self.hysteresis = int(cfg.growth_interval), int(cfg.hysteresis)
        self._growth_step = 0
        self._hysteresis_step = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self._hysteresis_step += 1
            self._growth_step = 0
            if self._hysteresis_step >= self.hysteresis:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_step += 1
            if self._growth_step == self.growth_interval:
                self._growth_step = 0
                self._hysteresis_step = 0
                self.scale = min(self.scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_step": self._growth_step, "hysteresis_step": self._hysteresis_step}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self._growth_step = int(sd["growth_step"])
        self._hysteresis_step = int(sd["hysteresis_step"])
