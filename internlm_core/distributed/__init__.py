"""Process-group init (torchrun / SLURM / single), ParallelDims and device meshes, seeding."""

from .launch import LaunchInfo, destroy_distributed, detect_launcher, expand_nodelist, init_distributed, slurm_env_to_torch
from .parallel_dims import ParallelDims
from .seed import set_deterministic, set_seed
from .simulate import init_simulated

__all__ = ["LaunchInfo", "ParallelDims", "destroy_distributed", "detect_launcher", "expand_nodelist",
           "init_distributed", "init_simulated", "set_deterministic", "set_seed", "slurm_env_to_torch"]
