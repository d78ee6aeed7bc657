"""AdamW (torch fused / foreach / apex), Muon, warm-up cosine and WSD lr, beta2 scheduler, fp16 grad scaler, clipping."""

from .clip import clip_and_check, clip_to_norm, global_grad_norm, unscale_and_norm
from .grad_scaler import DynamicGradScaler
from .optimizer import build_optimizer, param_groups
from .schedulers import Beta2Scheduler, WarmupCosineLR, WarmupStableDecayLR

__all__ = ["Beta2Scheduler", "DynamicGradScaler", "WarmupCosineLR", "WarmupStableDecayLR", "build_optimizer",
           "clip_and_check", "clip_to_norm", "global_grad_norm", "param_groups", "unscale_and_norm"]
