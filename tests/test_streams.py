"""Streams (IterableDatasets): each sample once per pass over ranks x loader workers, a
position that survives torch.save / torch.load(weights_only=True) and resumes in a new
loader bit-equal to an uninterrupted one, random windows of a token file."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from echelon3.config.build import instantiate
from echelon3.config.errors import BuildError, ConfigError
from echelon3.data.loaders import create_dataloader, create_dataloaders, set_epoch, skip_batches
from echelon3.data.rng import sample_seed
from echelon3.data.streams import (has_position, loader_position, resume_position, shard_info,
                                   stream_seed)
from echelon3.datasets.token_windows import TokenWindows, write_tokens
from tests.streams import FEATURES, NoisyIds

SEED, SIZE, WORLD = 7, 26, 2


def _loader(dataset, rank, workers, batch=4, train=True, spec=None):
    spec = spec or {"config": {"batch_size": batch * WORLD, "num_workers": workers}}
    return create_dataloader("train" if train else "test", spec, dataset, train=train,
                             rank=rank, world_size=WORLD, seed=SEED)


def _batches(iterator, count=None):
    out = []
    for batch in iterator:
        out.append([t.clone() for t in batch])
        if count is not None and len(out) == count:
            break
    return out


def _reloaded(position):
    buffer = io.BytesIO()
    torch.save(position, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _assert_same(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("workers", [0, 2])
def test_every_sample_once_per_pass_over_ranks_and_workers(workers):
    passes = {}
    for epoch in (0, 1):
        ids = []
        for rank in range(WORLD):
            loader = _loader(NoisyIds(SIZE), rank, workers)
            assert isinstance(loader, StatefulDataLoader) and has_position(loader)
            set_epoch(loader, epoch)
            batches = _batches(loader)
            ids += [int(i) for _, sample in batches for i in sample]
            for features, sample in batches:  # the augmentation is noise around the id
                assert features.shape[1] == FEATURES
                assert torch.all((features - sample[:, None].float()).abs() < 6)
        assert sorted(ids) == list(range(SIZE))
        passes[epoch] = ids
    assert passes[0] != passes[1]  # a new order each epoch


def test_the_augmentation_is_seeded_by_seed_epoch_shard_and_count():
    stream = NoisyIds(SIZE, seed=SEED)
    stream.set_shard(1, WORLD)
    stream.set_epoch(3)
    order = torch.randperm(SIZE, generator=torch.Generator().manual_seed(
        sample_seed(SEED, 3, -1)))
    for k, (features, index) in enumerate(stream):
        assert index == int(order[1 + k * WORLD])
        generator = torch.Generator().manual_seed(stream_seed(SEED, 3, 1, k))
        expected = float(index) + torch.randn(FEATURES, generator=generator)
        assert torch.equal(features, expected)
    assert k == SIZE // WORLD - 1


@pytest.mark.parametrize("workers", [0, 2])
def test_a_restored_position_yields_the_remaining_batches_bit_equal(workers):
    for rank in range(WORLD):
        straight = _loader(NoisyIds(SIZE), rank, workers)
        set_epoch(straight, 1)
        expected = _batches(straight)
        stopped = _loader(NoisyIds(SIZE), rank, workers)
        set_epoch(stopped, 1)
        done = _batches(iter(stopped), count=2)
        position = _reloaded(loader_position(stopped))
        fresh = _loader(NoisyIds(SIZE), rank, workers)
        set_epoch(fresh, 1)
        resume_position(fresh, position)
        _assert_same(done + _batches(fresh), expected)
        _assert_same(_batches(fresh), _batches(straight))  # the next pass starts afresh


def test_a_position_taken_at_the_end_of_a_pass_starts_the_next_afresh():
    loader = _loader(NoisyIds(SIZE), 0, 0)
    first = _batches(loader)
    position = _reloaded(loader_position(loader))
    fresh = _loader(NoisyIds(SIZE), 0, 0)
    resume_position(fresh, position)
    _assert_same(_batches(fresh), first)


def test_stream_loaders_refuse_what_they_cannot_do():
    loader = _loader(NoisyIds(SIZE), 0, 0)
    with pytest.raises(TypeError):
        len(loader)
    with pytest.raises(TypeError, match="resume_position"):
        skip_batches(loader, 1)
    with pytest.raises(ConfigError, match=r"^dataloaders.train.config.shuffle: "):
        _loader(NoisyIds(SIZE), 0, 0, spec={"config": {"batch_size": 2, "shuffle": True}})
    position = loader_position(loader)
    with pytest.raises(ConfigError, match=r"^dataloaders.train.config.num_workers: .* 0 "):
        resume_position(_loader(NoisyIds(SIZE), 0, 2), position)
    own = _loader(NoisyIds(SIZE), 0, 0, spec={"module": "torch.utils.data", "type": "DataLoader",
                                              "partial": False, "config": {"batch_size": 2}})
    assert isinstance(own, StatefulDataLoader)  # the default spec, written out
    mine = {"module": "tests.test_streams", "type": "PlainLoader", "config": {"batch_size": 2}}
    users = _loader(NoisyIds(SIZE), 0, 0, spec=mine)
    assert not has_position(users) and loader_position(users) is None
    resume_position(users, None)
    with pytest.raises(ConfigError, match=r"^dataloaders.train.type: a PlainLoader keeps no"):
        resume_position(users, position)


class PlainLoader(DataLoader):
    """A loader type of the user's own (no position)."""


@pytest.mark.parametrize("workers", [0, 2])
def test_an_evaluation_stream_is_read_once_across_ranks(workers):
    ids = []
    for rank in range(WORLD):
        loaders_cfg = {"test": {"config": {"batch_size": 6, "num_workers": workers}}}
        _, tests = create_dataloaders(loaders_cfg, None, {"test": NoisyIds(SIZE)}, rank=rank,
                                      world_size=WORLD, seed=SEED)
        assert not isinstance(tests["test"], StatefulDataLoader)
        ids += [int(i) for _, sample in tests["test"] for i in sample]
    assert sorted(ids) == list(range(SIZE))


def test_shard_info_outside_a_loader_is_one_shard_per_rank():
    assert shard_info() == (0, 1)
    assert shard_info(3, 4) == (3, 4)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    array = np.random.default_rng(0).integers(0, 65536, size=300).astype(np.int64)
    path = write_tokens(tmp_path_factory.mktemp("tokens") / "train.bin", array)
    return path, array


def test_token_windows_are_slices_at_hand_seeded_offsets(tokens):
    path, array = tokens
    block = 16
    stream = TokenWindows(str(path), block_size=block, seed=SEED, samples=9)
    windows = list(stream)
    assert len(windows) == 9
    for k, (x, y) in enumerate(windows):
        generator = torch.Generator().manual_seed(stream_seed(SEED, 0, 0, k))
        i = int(torch.randint(len(array) - block, (1,), generator=generator))
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(x, torch.from_numpy(array[i:i + block]))
        assert torch.equal(y, torch.from_numpy(array[i + 1:i + block + 1]))


@pytest.mark.parametrize("workers", [0, 2])
def test_token_windows_resume_exactly(tokens, workers):
    path, _ = tokens
    make = lambda: TokenWindows(str(path), block_size=8, samples=40)  # noqa: E731
    straight = _batches(_loader(make(), 1, workers, batch=3))
    stopped = _loader(make(), 1, workers, batch=3)
    done = _batches(iter(stopped), count=3)
    fresh = _loader(make(), 1, workers, batch=3)
    resume_position(fresh, _reloaded(loader_position(stopped)))
    _assert_same(done + _batches(fresh), straight)
    assert sum(len(x) for x, _ in straight) == 20  # half of the pass on this rank


def test_endless_token_windows_keep_drawing(tokens):
    path, _ = tokens
    loader = _loader(TokenWindows(str(path), block_size=8), 0, 0, batch=2)
    assert len(_batches(iter(loader), count=50)) == 50


def test_bad_token_files_name_the_key(tmp_path, tokens):
    path, _ = tokens
    spec = {"module": "echelon3.datasets.token_windows", "type": "TokenWindows",
            "config": {"path": str(path), "block_size": 8, "samples": 5, "seed": 1}}
    assert len(list(instantiate(spec, "data.val"))) == 5
    short = write_tokens(tmp_path / "short.bin", np.arange(8))
    spec["config"] = {"path": str(short), "block_size": 8}
    with pytest.raises(BuildError, match=r"^data.val: TokenWindows rejected .*path: .* holds "
                       r"8 tokens, too few for one window of block_size 8"):
        instantiate(spec, "data.val")
    spec["config"]["path"] = str(tmp_path / "missing.bin")
    with pytest.raises(BuildError, match=r"^data.train: .*path: no token file at"):
        instantiate(spec, "data.train")
    with pytest.raises(ValueError, match="0..65535"):
        write_tokens(tmp_path / "big.bin", np.array([70000]))
