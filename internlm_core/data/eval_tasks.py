"""Multiple-choice task files for evaluation during training: reading, tokenizing as lm-evaluation-harness does, and
packing the (context + choice) requests into rows the trainer's evaluation forward takes.

A task file is JSON lines, one document per line::

    {"context": "The capital of France is", "choices": ["Paris", "Rome"], "gold": 0}

Each choice becomes one request, scored as lm-eval's `multiple_choice` output type scores it (its HF backend,
version 0.4.x): the continuation is `target_delimiter + choice` (" " by default); trailing spaces of the context
move to the continuation; context and context + continuation are encoded and the continuation's tokens are those of
the whole past the context's length; the input is the last `seq_len + 1` tokens of the two, less the last one. BOS
starts every context when the tokenizer has one (our Hugging Face export's tokenizer adds it: lm-eval's
`add_bos_token=True`).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..errors import ConfigError, DataError
from .packing import IGNORE_INDEX


@dataclass(frozen=True)
class ChoiceDoc:
    """One document of a task file."""

    context: str
    choices: tuple[str, ...]
    gold: int


@dataclass(frozen=True)
class EvalTask:
    """A named task: its documents, in file order."""

    name: str
    path: str
    docs: tuple[ChoiceDoc, ...]


def _parse_doc(line: str, where: str) -> ChoiceDoc:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected an object {{\"context\": str, \"choices\": [str, ...], \"gold\": int}}")
    context, choices, gold = rec.get("context"), rec.get("choices"), rec.get("gold")
    if not isinstance(context, str) or not context:
        raise DataError(f"{where}: \"context\": expected a non-empty string, got {context!r}")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise DataError(f"{where}: \"choices\": expected a list of at least 2 non-empty strings, got {choices!r}")
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
        raise DataError(f"{where}: \"gold\": expected the index of the right choice (0..{len(choices) - 1}), "
                        f"got {gold!r}")
    return ChoiceDoc(context, tuple(choices), gold)


def read_task(name: str, path: str, key: str) -> EvalTask:
    """The documents of one task file; `key` names the config entry (`evaluation.tasks[0].path`) for errors."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{key}: no such task file {path!r} (expected a .jsonl of "
                          f"{{\"context\", \"choices\", \"gold\"}} lines)")
    docs = []
    with open(p, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                docs.append(_parse_doc(line, f"{path}:{n}"))
    if not docs:
        raise DataError(f"{path}: no documents (task {name!r})")
    return EvalTask(name, str(path), tuple(docs))


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's `_encode_pair` for causal models: trailing spaces of the
    context go to the continuation; the continuation's ids are those of the whole past the context's length."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    bos = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []
    whole = bos + list(tokenizer.encode(context + continuation))
    ctx = bos + list(tokenizer.encode(context))
    return ctx, whole[len(ctx):]


@dataclass(frozen=True, eq=False)
class Request:
    """One (document, choice): the tokens of its row (`input`, then the last one, predicted only) and how many
    of the last ones are the continuation that is scored."""

    task: int
    doc: int
    choice: int
    tokens: np.ndarray  # int32: input + [last target], lm-eval's (context + continuation)[-(seq_len + 1):]
    n_scored: int       # the continuation's tokens (the last n_scored of `tokens`)


def build_requests(tasks: Sequence[EvalTask], tokenizer: Any, seq_len: int, vocab_size: int,
                   target_delimiter: str = " ") -> list[Request]:
    """Every choice of every document of every task, tokenized and left-truncated to `seq_len` inputs."""
    out = []
    for t, task in enumerate(tasks):
        for d, doc in enumerate(task.docs):
            for c, choice in enumerate(doc.choices):
                ctx, cont = encode_pair(tokenizer, doc.context, target_delimiter + choice)
                where = f"{task.path}: document {d + 1}, choice {c}"
                if not cont:
                    raise DataError(f"{where}: the continuation {choice!r} encodes to no tokens")
                if len(cont) > seq_len:
                    raise DataError(f"{where}: the continuation has {len(cont)} tokens, more than data.seq_len "
                                    f"({seq_len})")
                tokens = (ctx + cont)[-(seq_len + 1):]
                if max(tokens) >= vocab_size:
                    raise DataError(f"{where}: token id {max(tokens)} is outside the model's vocabulary "
                                    f"[0, {vocab_size}) (model.vocab_size); is `tokenizer` the run's tokenizer?")
                out.append(Request(t, d, c, np.asarray(tokens, dtype=np.int32), len(cont)))
    return out


def pack_rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Indices of `lengths` packed into rows of at most `seq_len` (best fit, longest first); deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row index), sorted
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, r = free.pop(at)
            rows[r].append(i)
        else:
            room, r = seq_len, len(rows)
            rows.append([i])
        if room - n > 0:
            bisect.insort(free, (room - n, r))
    return rows


def deal_batches(requests: Sequence[Request], seq_len: int, rows_per_batch: int, dp_rank: int,
                 dp_size: int) -> list[list[list[int]]]:
    """This rank's batches as the request indices of each row. Rows are packed from all requests, then dealt to
    the data-parallel ranks in turn; every rank gets the same number of batches of `rows_per_batch` rows (empty
    rows fill the last ones), so that their forwards (and FSDP's gathers) pair up."""
    rows = pack_rows([len(r.tokens) - 1 for r in requests], seq_len)
    mine = rows[dp_rank::dp_size]
    per_rank = -(-len(rows) // dp_size)
    chunks = [mine[b:b + rows_per_batch] for b in range(0, per_rank, rows_per_batch)]
    return [chunk + [[]] * (rows_per_batch - len(chunk)) for chunk in chunks]


def make_batch(requests: Sequence[Request], rows: Sequence[Sequence[int]], seq_len: int) -> dict:
    """One batch in the trainer's layout (one micro-batch of len(rows) rows of seq_len): the requests of each row
    side by side as documents (positions restart; padding after them is one more), labels only on the
    continuations. `type_ids` holds the index of the request each scored label belongs to (-1 elsewhere): it
    travels with the labels through every cut of the rows (pipeline micro-batches, context-parallel chunks)."""
    n = len(rows) * seq_len
    inputs = np.zeros(n, dtype=np.int64)
    labels = np.full(n, IGNORE_INDEX, dtype=np.int64)
    owner = np.full(n, -1, dtype=np.int64)
    positions = np.zeros(n, dtype=np.int64)
    cu = [0]
    for k, ids in enumerate(rows):
        at = k * seq_len
        for i in ids:
            r = requests[i]
            length = len(r.tokens) - 1
            inputs[at:at + length] = r.tokens[:-1]
            labels[at + length - r.n_scored:at + length] = r.tokens[-r.n_scored:]
            owner[at + length - r.n_scored:at + length] = i
            positions[at:at + length] = np.arange(length)
            at += length
            cu.append(at)
        end = (k + 1) * seq_len
        if at < end:  # the padding: a document of its own
            positions[at:end] = np.arange(end - at)
            cu.append(end)
    return {"input_ids": torch.from_numpy(inputs)[None], "labels": torch.from_numpy(labels)[None],
            "position_ids": torch.from_numpy(positions)[None], "type_ids": torch.from_numpy(owner)[None],
            "cu_seqlens": [torch.tensor(cu, dtype=torch.int32)]}


def choice_metrics(task: EvalTask, loglikelihoods: Sequence[Sequence[float]]) -> dict[str, float]:
    """lm-eval's multiple-choice metrics of one task from each document's choice log-likelihoods: acc (argmax of
    the log-likelihood, first on ties), acc_norm (argmax of the log-likelihood over the choice's length in
    characters, as lm-eval 0.4's acc_norm divides), loglik (mean log-likelihood of the right choice)."""
    acc = norm = gold_ll = 0.0
    for doc, lls in zip(task.docs, loglikelihoods):
        lengths = [float(len(c)) for c in doc.choices]
        acc += max(range(len(lls)), key=lambda i: (lls[i], -i)) == doc.gold
        norm += max(range(len(lls)), key=lambda i: (lls[i] / lengths[i], -i)) == doc.gold
        gold_ll += lls[doc.gold]
    n = len(task.docs)
    return {"acc": acc / n, "acc_norm": norm / n, "loglik": gold_ll / n}


def per_doc(task_index: int, task: EvalTask, requests: Sequence[Request], values: Sequence[float],
            ) -> list[list[float]]:
    """The values of one task's requests as [document][choice]."""
    out: list[list[Optional[float]]] = [[None] * len(d.choices) for d in task.docs]
    for r, v in zip(requests, values):
        if r.task == task_index:
            out[r.doc][r.choice] = v
    return out  # type: ignore[return-value]
