"""Batch layouts: full rows, padded documents, packed documents; and rank sharding."""

from __future__ import annotations

import pytest

from bench import data

torch = pytest.importorskip("torch")


def test_full_rows_are_the_suites_historic_tokens() -> None:
    """The full layout draws exactly what the suite always drew: published first losses stay comparable."""
    gen = torch.Generator().manual_seed(3)
    expected = torch.randint(0, 100, (4, 2, 16), generator=gen)
    got = data.batches("full", 100, 2, 16, 4, 3, "cpu")
    assert all(torch.equal(b.input_ids, e) and torch.equal(b.labels, e) for b, e in zip(got, expected, strict=True))
    assert got[0].useful_tokens == 32 and set(got[0].model_inputs()) == {"input_ids", "labels"}


def test_padding_masks_and_ignores_the_padding() -> None:
    for b in data.batches("pad", 100, 4, 64, 5, 0, "cpu", min_doc_frac=0.25):
        lengths = b.attention_mask.sum(1)
        assert ((lengths >= 16) & (lengths <= 64)).all()
        assert ((b.labels == data.IGNORE) == (b.attention_mask == 0)).all()
        assert (b.input_ids[b.attention_mask == 0] == 0).all()
        assert b.useful_tokens == int(lengths.sum()) < b.input_ids.numel()
        assert b.position_ids is None


def test_packing_restarts_positions_at_each_document() -> None:
    for b in data.batches("pack", 100, 4, 64, 5, 0, "cpu", min_doc_frac=0.1):
        pos = b.position_ids
        assert (pos[:, 0] == 0).all() and b.attention_mask is None
        steps = pos[:, 1:] - pos[:, :-1]
        assert ((steps == 1) | (pos[:, 1:] == 0)).all()  # +1 inside a document, 0 where the next starts
        assert ((b.labels == data.IGNORE) == (pos == 0)).all()  # a document's first token is not a target
        assert b.useful_tokens == b.input_ids.numel()
    assert any((b.position_ids == 0).sum() > 4 for b in data.batches("pack", 100, 4, 64, 5, 0, "cpu"))


@pytest.mark.parametrize("layout", ["full", "pad", "dynpad", "pack"])
def test_ranks_split_the_global_batch(layout: str) -> None:
    """Two ranks at batch 1 see, between them, the tokens of one rank at batch 2."""
    whole = data.batches(layout, 100, 2, 32, 3, 7, "cpu")
    halves = [data.batches(layout, 100, 1, 32, 3, 7, "cpu", rank=r, world=2) for r in (0, 1)]
    for step, b in enumerate(whole):
        joined = torch.cat([halves[0][step].input_ids, halves[1][step].input_ids])
        assert torch.equal(joined, b.input_ids)


def test_micro_batches_split_every_field() -> None:
    b = data.batches("pad", 100, 4, 16, 1, 0, "cpu")[0]
    parts = b.chunk(2)
    assert [p.input_ids.shape[0] for p in parts] == [2, 2]
    assert sum(p.useful_tokens for p in parts) == b.useful_tokens
    assert all(p.position_ids is None for p in parts)


def test_packed_documents_attend_only_to_themselves() -> None:
    """What packing's docstring claims, checked on a real model: with position_ids restarting, the
    logits of a document inside a packed row equal those of the document alone (sdpa and eager)."""
    from transformers import AutoModelForCausalLM

    from bench import models

    for attention in ("sdpa", "eager"):
        config = models.hf_config(models.get("tiny-llama"), attention)
        config.use_cache = False  # as the worker builds it: with a KV cache transformers does not look for documents
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        first, second = torch.randint(0, 100, (1, 20)), torch.randint(0, 100, (1, 12))
        row = torch.cat([first, second], dim=1)
        positions = torch.cat([torch.arange(20), torch.arange(12)])[None]
        with torch.no_grad():
            packed = model(input_ids=row, position_ids=positions).logits[:, 20:]
            alone = model(input_ids=second).logits
            leaked = model(input_ids=row).logits[:, 20:]  # no position_ids: one long causal sequence
        assert torch.allclose(packed, alone, atol=1e-5), attention
        assert not torch.allclose(leaked, alone, atol=1e-3)


def test_dynamic_padding_pads_each_batch_to_its_longest_document() -> None:
    shuffled = data.batches("dynpad", 1000, 3, 256, 60, 0, "cpu", min_doc_frac=0.1)
    widths = [b.input_ids.shape[-1] for b in shuffled]
    assert len(set(widths)) > 20 and max(widths) <= 256 and min(widths) >= 25  # shapes change step to step
    for b in shuffled:
        lengths = b.attention_mask.sum(dim=1)
        assert int(lengths.max()) == b.input_ids.shape[-1]  # padded to its own longest document, no further
        assert ((b.labels == data.IGNORE) == (b.attention_mask == 0)).all()
    ascending = [b.input_ids.shape[-1] for b in data.batches("dynpad", 1000, 3, 256, 60, 0, "cpu", order="sorted")]
    assert ascending == sorted(ascending) and ascending[0] < 64 and ascending[-1] > 240  # the staircase's order
    again = data.batches("dynpad", 1000, 3, 256, 60, 0, "cpu", min_doc_frac=0.1)
    assert all((a.input_ids == b.input_ids).all() for a, b in zip(shuffled, again, strict=True))  # seeded
