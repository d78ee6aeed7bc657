"""TrainState (InternLM's fields, Stateful) and BatchSkipper (skip_batches="3,10-20")."""

from __future__ import annotations

from typing import Optional

from ..errors import ConfigError


class TrainState:
    """Progress of a run; saved in every checkpoint.

    batch_count: batches consumed so far, skipped ones included (the next batch has this 0-based index;
        the `step` of metrics, validation, checkpoints and `total_steps` is this count).
    step_count: successful optimizer updates.
    num_consumed_samples_in_epoch: packed rows consumed in the current epoch by this data-parallel rank.
    num_consumed_tokens: tokens consumed by the whole job (all data-parallel ranks).
    inf_nan_skip_batches: updates skipped because the gradient was inf/nan.
    tensorboard_folder: where this run's TensorBoard events go (kept on resume).
    """

    def __init__(self, tensorboard_folder: Optional[str] = None):
        self.batch_count = 0
        self.step_count = 0
        self.num_consumed_samples_in_epoch = 0
        self.num_consumed_tokens = 0
        self.inf_nan_skip_batches = 0
        self.tensorboard_folder = tensorboard_folder

    def state_dict(self) -> dict:
        return {"batch_count": self.batch_count, "step_count": self.step_count,
                "num_consumed_samples_in_epoch": self.num_consumed_samples_in_epoch,
                "num_consumed_tokens": self.num_consumed_tokens,
                "inf_nan_skip_batches": self.inf_nan_skip_batches,
                "tensorboard_folder": self.tensorboard_folder or ""}

    def load_state_dict(self, sd: dict) -> None:
        self.batch_count = int(sd["batch_count"])
        self.step_count = int(sd["step_count"])
        self.num_consumed_samples_in_epoch = int(sd["num_consumed_samples_in_epoch"])
        self.num_consumed_tokens = int(sd["num_consumed_tokens"])
        self.inf_nan_skip_batches = int(sd["inf_nan_skip_batches"])
        self.tensorboard_folder = sd.get("tensorboard_folder") or self.tensorboard_folder

    def __repr__(self) -> str:
        return f"TrainState({self.state_dict()})"


def parse_skip_batches(spec: str) -> set[int]:
    """"3,10-20" → {3, 10, 11, ..., 20} (InternLM's semantics: inclusive ranges of 0-based batch indices)."""
    out: set[int] = set()
    for part in (p.strip() for p in str(spec or "").split(",")):
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise ConfigError(f"data.skip_batches: cannot read {part!r} in {spec!r}; "
                              f"expected comma-separated integers or ranges like \"3,10-20\"") from None
    return out


class BatchSkipper:
    """`skipper(batch_index)` is True for a batch to skip; counts how many were skipped."""

    def __init__(self, skip_batches: str | set[int]):
        self.skip_batches = parse_skip_batches(skip_batches) if isinstance(skip_batches, str) else set(skip_batches)
        self.num_skipped = 0

    def __call__(self, batch_index: int) -> bool:
        if batch_index in self.skip_batches:
            self.num_skipped += 1
            return True
        return False

    def add(self, indices: set[int] | list[int]) -> None:
        """Skip these batch indices too (the spike rewind adds the batches that spiked)."""
        self.skip_batches.update(int(i) for i in indices)

    def state_dict(self) -> dict:
        """The batches to skip, saved so that a restart still skips the ones added during the run."""
        return {"skip_batches": sorted(self.skip_batches)}

    def load_state_dict(self, sd: dict) -> None:
        """Union with the batches already known (the config's and those added since the checkpoint)."""
        self.add(sd.get("skip_batches", []))
