"""What the step loop is given that is not a component of its own: `LoopConfig` (the config values the loop reads,
resolved once) and `TrainLoader` (what the loop needs of its training data loader)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping, Protocol, runtime_checkable

from ..config import Config
from ..errors import DataError


def check_vocab(batch: dict, vocab_size: int, step: int) -> None:
    """DataError naming batch `step` when a token id of `batch` lies outside the model's vocabulary."""
    vmax = int(batch["input_ids"].max())
    if vmax >= vocab_size or int(batch["input_ids"].min()) < 0:
        raise DataError(f"batch {step}: token id {vmax} is outside the model's vocabulary [0, {vocab_size}) "
                        f"(model.vocab_size); was the data tokenized with another tokenizer?")


@runtime_checkable
class TrainLoader(Protocol):
    """The training loader as the loop uses it: batches in order, and its position, saved in every checkpoint and
    restored when replica groups retry a step, and what the training metric names and counts per dataset type
    (data.loader's `TrainLoader` and data.streaming's `StreamingLoader` both implement all of it)."""

    def __iter__(self) -> Iterator[dict]: ...

    @property
    def type_names(self) -> Mapping[int, str]: ...  # dataset type id -> name (acc/{name}, loss/{name})

    def consumed_tokens_per_type(self) -> Mapping[str, int]: ...  # all ranks' tokens of each type so far

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...


@dataclass(frozen=True)
class LoopConfig:
    """What the step loop needs of the config, resolved once by `build_trainer`."""

    seq_len: int
    vocab_size: int
    total_steps: int
    micro_num: int
    packed_length: int
    valid_every: int
    clip_grad_norm: float
    dtype: str                 # model.dtype (autocast)
    label_smoothing: float
    loss_reduction: str        # loss.reduction: token_mean or micro_batch_mean (loss_norm.py)
    vocab_parallel_loss: bool  # tensor parallel with parallel_output: logits stay vocabulary-sharded
    validate_at_end: bool = False  # data.valid_every > 0 or a valid_folder: validate once more after the last step
    # a simulated job (train.py --simulate): fake peers deliver garbage gradients; step anyway, so that the
    # optimizer state exists and the memory is that of the real job
    simulated: bool = False

    @classmethod
    def from_config(cls, cfg: Config, tp: int, simulated: bool = False) -> "LoopConfig":
        """The loop's view of `cfg`. A simulated rank skips validation: a forward-only pass needs less memory
        than a training step, and on a CPU it costs minutes."""
        d = cfg.data
        return cls(seq_len=d.seq_len, vocab_size=cfg.model.vocab_size, total_steps=d.total_steps,
                   micro_num=d.micro_num, packed_length=d.packed_length,
                   valid_every=0 if simulated else d.valid_every,
                   clip_grad_norm=cfg.hybrid_zero_optimizer.clip_grad_norm, dtype=cfg.model.dtype,
                   label_smoothing=cfg.loss.label_smoothing, loss_reduction=cfg.loss.reduction,
                   vocab_parallel_loss=tp > 1 and cfg.model.parallel_output,
                   validate_at_end=not simulated and (d.valid_every > 0 or d.valid_folder is not None),
                   simulated=simulated)
