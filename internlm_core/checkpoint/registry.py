"""What a checkpoint holds: the model and its optimizer (through DCP's state_dict API) and every other registered
Stateful, each under a content name (what `load_ckpt_info.content` selects) and a scope (how many copies)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from ..config.ckpt_names import CONTENTS  # the config checks load_ckpt_info.content against the same names
from ..errors import CheckpointError
from .collectives import Collectives

SCOPES = ("global", "dp_rank", "rank")
_RESERVED = ("model", "optimizer")


def normalize_content(content: Iterable[str] | str | None) -> tuple[str, ...]:
    """InternLM's load content → the parts to load, in CONTENTS order ("all" = everything)."""
    if content is None:
        return CONTENTS
    items = [content] if isinstance(content, str) else list(content)
    items = [str(c).lower() for c in items]
    bad = [c for c in items if c not in (*CONTENTS, "all")]
    if bad:
        raise CheckpointError(f"ckpt.load_ckpt_info.content: unknown {bad}; expected any of "
                              f"{', '.join(CONTENTS)}, all")
    if "all" in items:
        return CONTENTS
    return tuple(c for c in CONTENTS if c in items)


def jsonable(value: Any) -> Any:
    """A state dict as JSON can hold it (tensors and other objects as their text)."""
    return json.loads(json.dumps(value, default=str))


@dataclass
class Entry:
    """One registered Stateful: saved as `obj.state_dict()` under `name`."""

    name: str
    obj: Any
    content: str
    scope: str
    strict: bool

    def key(self, dp_rank: int, rank: int) -> str:
        """The sub-key of this process's copy ("" for a global entry, "dp3", "rank5")."""
        return "" if self.scope == "global" else f"dp{dp_rank}" if self.scope == "dp_rank" else f"rank{rank}"


class StateRegistry:
    """The model, its optimizer and the other registered Statefuls of one run."""

    def __init__(self) -> None:
        self.model: Optional[torch.nn.Module] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.entries: dict[str, Entry] = {}

    def register_model(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """The model (content "model") and its optimizer (content "optimizer")."""
        self.model, self.optimizer = model, optimizer

    def register(self, name: str, obj: Any, *, content: str, scope: str = "global", strict: bool = True) -> None:
        """See CheckpointManager.register."""
        if obj is None:
            return
        if content not in CONTENTS:
            raise ValueError(f"register {name!r}: content must be one of {CONTENTS}, got {content!r}")
        if scope not in SCOPES:
            raise ValueError(f"register {name!r}: scope must be one of {SCOPES}, got {scope!r}")
        if name in _RESERVED or name in self.entries or "." in name:
            raise ValueError(f"register {name!r}: name taken, reserved or dotted")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"register {name!r}: {type(obj).__name__} has no state_dict()/load_state_dict()")
        self.entries[name] = Entry(name, obj, content, scope, strict)

    @property
    def registered(self) -> dict[str, tuple[str, str]]:
        """{name: (content, scope)} of everything saved besides model and optimizer."""
        return {e.name: (e.content, e.scope) for e in self.entries.values()}

    def model_state(self, with_optimizer: bool) -> tuple[dict, Optional[dict]]:
        """The model's (and optionally the optimizer's) state dict as DCP sees it (flattened optimizer state)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_state_dict)
        if self.model is None:
            raise CheckpointError("no model registered with the checkpoint manager")
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        if with_optimizer and self.optimizer is not None:
            return get_state_dict(self.model, self.optimizer, options=opts)
        return get_model_state_dict(self.model, options=opts), None

    def collect(self, dp_rank: int, rank: int) -> dict:
        """The whole state to save, as DCP sees it."""
        msd, osd = self.model_state(with_optimizer=True)
        state: dict[str, Any] = {"model": msd}
        if osd is not None:
            state["optimizer"] = osd
        for e in self.entries.values():
            sd = e.obj.state_dict()
            sub = e.key(dp_rank, rank)
            state[e.name] = {sub: sd} if sub else sd
        return state

    def dp_rank_states(self, coll: Collectives, dp_rank: int) -> dict[str, dict[str, Any]]:
        """{entry: {"dp0": state, "dp1": ...}} of every dp_rank-scoped entry, gathered to every rank (small)."""
        mine = {e.name: jsonable(e.obj.state_dict()) for e in self.entries.values() if e.scope == "dp_rank"}
        if not mine:
            return {}
        out: dict[str, dict[str, Any]] = {name: {} for name in mine}
        for rank_dp, states in coll.all_gather((dp_rank, mine)):
            for name, sd in states.items():
                out[name][f"dp{rank_dp}"] = sd
        return out

    def global_states(self) -> dict[str, Any]:
        """{entry: its state as JSON} of every global entry."""
        return {e.name: jsonable(e.obj.state_dict()) for e in self.entries.values() if e.scope == "global"}

    def contents(self) -> dict[str, list[str]]:
        """{content: what it holds}, as meta.json records it."""
        out: dict[str, list[str]] = {c: [] for c in CONTENTS}
        out["model"].append("model")
        if self.optimizer is not None:
            out["optimizer"].append("optimizer")
        for e in self.entries.values():
            out[e.content].append(e.name if e.scope == "global" else f"{e.name} (one per {e.scope})")
        return out
