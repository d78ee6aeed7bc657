"""`python train.py ARGS` whose peak resident memory measures tensors, for the memory tests.

glibc is set to follow the live tensors (`utils.memory.track_live_cpu_memory`: freed blocks go back to the OS
at once, as a simulated rank runs) instead of training's faster keep-freed setting, so a CPU run's per-step peak
RSS (the memory report) is what the tensors needed, as `max_memory_allocated` is on a GPU. Being a runtime
setting, it also holds in a process forked from the warm test interpreter (tests/helpers/warm.py).

    python tests/helpers/train_live_memory.py [--grad-reduce micro_batch|step] TRAIN_ARGS...

`--grad-reduce` forces how FSDP reduces gradients under accumulation (the layout's choice otherwise).
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import internlm_core.model.init as init  # noqa: E402
import internlm_core.numerics.kernels as kernels  # noqa: E402
import internlm_core.trainer.build as build_module  # noqa: E402
from internlm_core.utils.memory import track_live_cpu_memory  # noqa: E402

args = sys.argv[1:]
if args[:1] == ["--grad-reduce"]:
    mode, args = args[1], args[2:]
    kernels.select_grad_reduce = lambda *a, **k: mode
if not track_live_cpu_memory():
    sys.exit("train_live_memory.py: glibc's allocator could not be set (MALLOC_* or GLIBC_TUNABLES set, or no glibc)")
build_module.keep_freed_cpu_memory = lambda: False  # training's setting would keep freed memory resident
if os.environ.get("LIVE_MEMORY_TORCH_INIT") == "1":
    # where the weights' values play no part in what is measured, only their bytes: torch's generator instead of
    # the counter-based one (model/init.py, whose values the init tests check; several times slower under this
    # allocator setting). test_grad_accumulation_memory keeps the real one: its measured difference moved from
    # 0.99 to 0.87 of the estimate with torch's generator.
    init.draw_normal_ = lambda local, index, shape, stream, mean, std: local.normal_(mean, std)

import train  # noqa: E402

sys.exit(train.main(args))
