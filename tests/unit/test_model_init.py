"""Initialization from a counter-based stream (model/init.py, model/counter_rng.py): Philox4x32-10 as published,
N(0, std) values, and every part of a parameter (rows, columns, strided pieces, any block size) bitwise equal to the
same elements of the whole; tests/dist/test_init_sharded.py does the same with DTensor shards on two gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch

from internlm_core.model import init as model_init
from internlm_core.model.counter_rng import ParameterStream, philox4x32
from internlm_core.model.init import ShardValues, init_parameters, parameter_generator

M = 0xFFFFFFFF


@pytest.mark.parametrize("counter,key,expected", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M, M, M, M), (M, M), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox4x32_10_known_answers(counter, key, expected):
    """Random123's known-answer vectors (kat_vectors: philox4x32 10 rounds)."""
    words = philox4x32(*(torch.tensor([c], dtype=torch.int64) for c in counter), *key)
    assert tuple(int(w) for w in words) == expected


def whole(shape, seed=7, name="w", std=0.02, mean=0.0):
    full = torch.empty(shape)
    ShardValues(full, [torch.arange(n) for n in shape], tuple(shape), parameter_generator(seed, name)).normal_(
        mean, std)
    return full


def part(shape, index, seed=7, name="w", std=0.02, mean=0.0):
    local = torch.empty([len(i) for i in index])
    ShardValues(local, index, tuple(shape), parameter_generator(seed, name)).normal_(mean, std)
    return local


def test_values_are_normal_with_the_asked_mean_and_std():
    x = whole((512, 512), std=0.02, mean=0.5).double().flatten() - 0.5
    n = x.numel()
    assert abs(x.mean().item()) < 4 * 0.02 / math.sqrt(n)
    assert abs(x.std().item() / 0.02 - 1) < 4 / math.sqrt(2 * n)
    z = x / 0.02
    assert abs((z ** 4).mean().item() - 3) < 0.05  # normal kurtosis, not a sum of uniforms' 2.9
    inside = [(z.abs() < k).double().mean().item() for k in (1, 2, 3)]
    assert inside == pytest.approx([0.6827, 0.9545, 0.9973], abs=3e-3)
    assert not torch.equal(whole((64, 64), seed=7), whole((64, 64), seed=8))
    assert not torch.equal(whole((64, 64), name="a"), whole((64, 64), name="b"))


@pytest.mark.parametrize("index", [
    lambda: [torch.arange(3, 9), torch.arange(33)],  # rows (data parallel's Shard(0))
    lambda: [torch.arange(10), torch.arange(17, 33)],  # columns, runs starting at any element (Shard(1))
    lambda: [torch.tensor([1, 2, 7, 8]), torch.arange(5, 11)],  # strided rows (FSDP over tensor parallel)
    lambda: [torch.arange(10), torch.tensor([0, 2, 4, 31])],  # a last dimension that is not contiguous
])
def test_any_part_equals_the_same_elements_of_the_whole(index):
    idx = index()
    full = whole((10, 33))
    assert torch.equal(part((10, 33), idx), full[idx[0]][:, idx[1]])


def test_values_do_not_depend_on_block_sizes(monkeypatch):
    full = whole((37, 300))
    monkeypatch.setattr(model_init, "_BLOCK_COUNTERS", {"cpu": 7, "cuda": 7})
    monkeypatch.setattr(model_init, "_MAX_RUN", 13)
    assert torch.equal(whole((37, 300)), full)
    assert torch.equal(part((37, 300), [torch.arange(5, 9), torch.arange(101, 277)]), full[5:9, 101:277])


def test_three_dimensional_and_scalar_parameters():
    full = whole((4, 6, 5))
    idx = [torch.arange(1, 3), torch.arange(6), torch.arange(2, 5)]
    assert torch.equal(part((4, 6, 5), idx), full[1:3, :, 2:5])
    assert whole(()).shape == () and torch.equal(whole(()), whole(()))


def test_init_parameters_fills_through_the_stream_and_refuses_a_generator():
    model = torch.nn.Linear(6, 4)

    def fill(name, values, generator):
        if name.endswith("bias"):
            values.fill_(0.5)
        else:
            values.normal_(0.0, 0.1, generator=generator)
    init_parameters(model, 3, fill)
    assert torch.equal(model.bias, torch.full((4,), 0.5))
    assert torch.equal(model.weight, whole((4, 6), seed=3, name="weight", std=0.1))
    with pytest.raises(TypeError, match="weight: normal_ draws from the parameter's counter-based stream"):
        init_parameters(model, 3, lambda name, values, g: values.normal_(0.0, 0.1, generator=torch.Generator()))
    assert isinstance(parameter_generator(3, "weight"), ParameterStream)
