"""The trainer's context-parallel cut (parallel/context.py ContextCut), alone: every rank's zigzag chunk of each
packed row, with the labels, positions, types and per-token document ids of the same tokens, and loss shares that
add up to the whole micro-batch's mean."""

import torch

from internlm_core.model import document_ids_from_cu_seqlens
from internlm_core.parallel.context import ROW_KEYS, ContextCut


def _micro_batch(rows: int = 2, seq_len: int = 32) -> dict:
    """Rows of several documents (row 0: 5 + 11 + 16 tokens, row 1: one of 32), some labels ignored (-100)."""
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 16, 32, 64], dtype=torch.int32)
    positions = torch.cat([torch.arange(int(b - a)) for a, b in zip(cu[:-1], cu[1:])]).view(rows, seq_len)
    labels = torch.randint(0, 100, (rows, seq_len), generator=g)
    labels[0, 4] = labels[0, 15] = labels[1, 20:] = -100
    return {"input_ids": torch.randint(0, 100, (rows, seq_len), generator=g), "labels": labels,
            "position_ids": positions, "type_ids": torch.randint(0, 3, (rows, seq_len), generator=g),
            "cu_seqlens": cu}


def test_zigzag_chunks_cover_each_row_once_with_their_tokens():
    mb = _micro_batch()
    rows, seq_len = mb["input_ids"].shape
    docs = document_ids_from_cu_seqlens(mb["cu_seqlens"], rows, seq_len)
    for size in (2, 4):
        seen = torch.zeros(rows, seq_len, dtype=torch.long)
        shares = 0.0
        for rank in range(size):
            out = ContextCut(size, rank)(mb)
            chunk = seq_len // (2 * size)
            # chunks rank and 2*size-1-rank, in that order
            idx = torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                             torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)])
            for k in ROW_KEYS:
                assert out[k].shape == (rows, seq_len // size) and out[k].is_contiguous()
                assert torch.equal(out[k], mb[k][:, idx]), (size, rank, k)
            assert torch.equal(out["document_ids"], docs[:, idx]) and out["document_ids"].device.type == "cpu"
            assert "cu_seqlens" not in out
            seen[:, idx] += 1
            counted = int((mb["labels"][:, idx] != -100).sum())
            assert out["loss_share"] == counted / int((mb["labels"] != -100).sum())
            shares += out["loss_share"]
        assert torch.equal(seen, torch.ones_like(seen))  # every token on exactly one rank
        assert abs(shares - 1.0) < 1e-12


def test_loss_shares_make_the_chunk_means_sum_to_the_row_mean():
    """sum over ranks of share * (mean over the chunk's counted tokens) = the mean over the micro-batch's."""
    mb = _micro_batch()
    token_loss = torch.rand(mb["labels"].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mb["input_ids"] = token_loss  # carried through the cut like any per-token tensor
    valid = mb["labels"] != -100
    whole = token_loss[valid].mean()
    total = 0.0
    for rank in range(4):
        out = ContextCut(4, rank)(mb)
        v = out["labels"] != -100
        total += out["loss_share"] * (out["input_ids"][v].sum() / max(int(v.sum()), 1))
    assert abs(float(total) - float(whole)) < 1e-12
    # a micro-batch without any counted token: share 0 (its loss is 0 on every rank, as on one)
    mb["labels"] = torch.full_like(mb["labels"], -100)
    assert ContextCut(2, 1)(mb)["loss_share"] == 0.0
