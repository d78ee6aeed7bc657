"""Context parallel adds no host sync (issue 34): the layout of a micro-batch is planned from the whole rows'
document ids the trainer's cut keeps on the host, without all-gathering the chunks' ids and reading them back
(a sync per forward, and a copy of every token index set to the device from pageable memory, before). Counted
on the CPU with tests/helpers/host_syncs.py; the layout equals the one planned from the gathered chunks."""

from __future__ import annotations

import pytest
import torch

from internlm_core.model import document_ids_from_cu_seqlens
from internlm_core.model.context import ContextGroup, zigzag_indices
from internlm_core.model.context import layout
from tests.helpers.host_syncs import HostSyncs

B, T = 2, 64
CU = torch.tensor([0, 5, 30, 64, 64 + 17, 128])


def _same(a, b) -> None:
    assert len(a.sources) == len(b.sources)
    for x, y in zip([a.query] + a.sources, [b.query] + b.sources):
        for field in ("index", "doc", "index_host", "doc_host"):
            assert torch.equal(getattr(x, field), getattr(y, field)), field
    assert [p.blocks for p in a.plans] == [p.blocks for p in b.plans]


@pytest.mark.parametrize("mode, size, inner", [("ring", 2, 1), ("all_to_all", 2, 1), ("ring", 4, 1), ("2d", 4, 2)])
def test_the_layout_from_the_rows_document_ids_reads_nothing_back(monkeypatch, mode, size, inner):
    docs = document_ids_from_cu_seqlens(CU, B, T)
    device = torch.device("cpu")

    def gather(parts, local, group=None):  # what the context ranks' all-gather returns: each rank's chunk
        for r, part in enumerate(parts):
            part.copy_(docs[:, zigzag_indices(T, size, r)])
    monkeypatch.setattr(layout.collectives, "all_gather", gather)
    for rank in range(size):
        ctx = ContextGroup(None, size, rank, mode, inner=inner)
        if mode == "2d":
            ctx.inner_group = object()  # set by make_inner_group on a real group; only passed on here
        with HostSyncs(device) as syncs:
            syncs.host(docs)
            meta = layout.build_context_meta(ctx, docs, B, T // size, device)
        assert syncs.events == [], syncs.sites
        chunk = docs[:, zigzag_indices(T, size, rank)]
        with HostSyncs(device) as before:
            before.host(chunk)
            gathered = layout.build_context_meta(ctx, chunk, B, T // size, device)
        assert ("d2h", "cpu") in before.events  # the chunks' path reads the gathered ids back
        _same(meta, gathered)


def test_the_cut_keeps_the_rows_document_ids_on_the_host():
    from internlm_core.parallel.context import ContextCut
    rows = torch.arange(B * T).view(B, T)
    mb = {"input_ids": rows, "labels": rows, "type_ids": rows * 0, "position_ids": rows % T, "cu_seqlens": CU}
    out = ContextCut(2, 1)(mb)
    assert torch.equal(out["row_document_ids"], document_ids_from_cu_seqlens(CU, B, T))
    assert out["row_document_ids"].device.type == "cpu"
