"""dataloader.py: which tokens each rank reads, shard changes and epochs, resuming, shuffling, and the errors
for bad shard files."""

import os
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import dataloader
from conftest import make_document_shards, make_shards
from dataloader import (
    EOT,
    HEADER_BYTES,
    MAGIC,
    VERSION,
    DistributedDataLoader,
    read_shard_header,
    write_shard,
)
from training.errors import UserError
from training.packing import pack_rows

B, T = 2, 4  # one chunk = B·T = 8 tokens (+1 for the last target)


def chunks(n: int) -> int:
    """Shard size holding exactly n chunks, nothing left over."""
    return n * B * T + 1


class Chunks:
    """Tells which (shard, offset) a batch came from, after checking it is exactly the shard's tokens there."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays
        self.where = {tuple(a[off : off + B * T]): (s, off)
                      for s, a in enumerate(arrays) for off in range(0, len(a) - B * T, B * T)}
        assert len(self.where) == sum((len(a) - 1) // (B * T) for a in arrays)  # random tokens: no two chunks alike

    def locate(self, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
        shard, off = self.where[tuple(x.flatten().tolist())]
        tokens = torch.from_numpy(self.arrays[shard].astype(np.int64))
        assert torch.equal(x, tokens[off : off + B * T].view(B, T))
        assert torch.equal(y, tokens[off + 1 : off + B * T + 1].view(B, T))
        return shard, off


def loaders(data_dir: Path, world_size: int, grad_accum_steps: int, **kw) -> list[DistributedDataLoader]:
    """One loader per simulated rank."""
    return [DistributedDataLoader(data_dir, "train", B, T, rank=r, world_size=world_size,
                                  grad_accum_steps=grad_accum_steps, **kw) for r in range(world_size)]


def global_step(ranks: list[DistributedDataLoader], grad_accum_steps: int, where: Chunks) -> list[list[tuple]]:
    """The chunks each rank reads during one optimizer step: [rank][micro-step] -> (shard, offset)."""
    return [[where.locate(*loader.next_batch()) for _ in range(grad_accum_steps)] for loader in ranks]


def test_batches_are_the_shard_tokens_in_order_with_y_shifted_by_one(tmp_path):
    arrays = make_shards(tmp_path, "train", [50, 40])  # (50-1)//8 = 6 chunks, (40-1)//8 = 4 chunks
    loader = DistributedDataLoader(tmp_path, "train", B, T)
    expected = [(0, 0), (0, 8), (0, 16), (0, 24), (0, 32), (0, 40), (1, 0), (1, 8), (1, 16), (1, 24), (0, 0)]
    for i, (shard, off) in enumerate(expected):
        assert loader.epoch == (1 if i == 10 else 0)
        x, y = loader.next_batch()
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (B, T)
        tokens = torch.from_numpy(arrays[shard].astype(np.int64))
        assert torch.equal(x, tokens[off : off + 8].view(B, T)), (i, shard, off)
        assert torch.equal(y, tokens[off + 1 : off + 9].view(B, T)), (i, shard, off)
        assert torch.equal(x.flatten()[1:], y.flatten()[:-1])


def test_ranks_change_shard_together_skipping_leftover_chunks_then_wrap(tmp_path):
    where = Chunks(make_shards(tmp_path, "train", [50, 40]))  # 6 and 4 chunks
    ranks = loaders(tmp_path, world_size=2, grad_accum_steps=2)  # an optimizer step takes 4 chunks
    # Shard 0: step 1 takes chunks 0-3 (rank r reads chunk 2·micro + r); chunks 4 and 5 (offsets 32, 40) cannot
    # make a whole step, so both ranks skip them and step 2 reads shard 1. Step 3 is epoch 1, shard 0 again.
    expected_steps = [[[(0, 0), (0, 16)], [(0, 8), (0, 24)]],
                      [[(1, 0), (1, 16)], [(1, 8), (1, 24)]],
                      [[(0, 0), (0, 16)], [(0, 8), (0, 24)]]]
    for step, expected in enumerate(expected_steps):
        assert global_step(ranks, 2, where) == expected, step
        assert ranks[0].state_dict() == ranks[1].state_dict()  # the position is the same on every rank
    assert [r.epoch for r in ranks] == [1, 1]


@pytest.mark.parametrize("shuffle", [False, True], ids=["in_order", "shuffled"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ranks_are_disjoint_and_together_read_what_one_rank_reads(tmp_path, world_size, shuffle):
    k = 2  # micro-steps per rank per optimizer step
    # 13, 9 and 17 chunks: with 8 chunks a step (4 ranks) shards leave 5, 1, 1 chunks over, with 4 or 2 some.
    where = Chunks(make_shards(tmp_path, "train", [chunks(13), chunks(9), chunks(17)]))
    ranks = loaders(tmp_path, world_size=world_size, grad_accum_steps=k, shuffle=shuffle, seed=5)
    (single,) = loaders(tmp_path, world_size=1, grad_accum_steps=world_size * k, shuffle=shuffle, seed=5)
    read_in_epoch_0 = set()
    for step in range(20):  # past one epoch for every world size (the longest: 1 rank, 36 chunks / 2 = 18 steps)
        epoch = ranks[0].epoch
        per_rank = global_step(ranks, k, where)
        union = Counter(c for rank_chunks in per_rank for c in rank_chunks)
        (reference,) = global_step([single], world_size * k, where)
        assert union == Counter(reference), step
        assert len(union) == world_size * k  # no chunk read twice in a step, so ranks are disjoint
        if epoch == 0:
            assert read_in_epoch_0.isdisjoint(union)  # and no chunk read twice in an epoch
            read_in_epoch_0 |= set(union)
    assert ranks[0].epoch == single.epoch >= 1


def states_at(position: str, loader: DistributedDataLoader, where: Chunks) -> None:
    """Advance loader to a mid-shard position (in epoch 0 or 1) or to right after a shard change."""
    while position == "mid_shard_epoch_1" and loader.epoch == 0:
        where.locate(*loader.next_batch())
    if position.startswith("mid_shard"):
        for _ in range(4):  # 2 optimizer steps of 2 chunks: every shard below has at least 6
            where.locate(*loader.next_batch())
        assert loader.state_dict()["chunk_position"] == 4 and loader.state_dict()["shard_position"] == 0
        assert loader.epoch == (1 if position == "mid_shard_epoch_1" else 0)
    else:
        while loader.state_dict()["shard_position"] == 0:
            where.locate(*loader.next_batch())
        assert loader.state_dict()["chunk_position"] == 0 and loader.state_dict()["shard_position"] == 1


@pytest.mark.parametrize("shuffle", [False, True], ids=["in_order", "shuffled"])
@pytest.mark.parametrize("position", ["mid_shard", "shard_boundary", "mid_shard_epoch_1"])
def test_resumed_loader_continues_with_the_next_batch(tmp_path, position, shuffle):
    where = Chunks(make_shards(tmp_path, "train", [chunks(7), chunks(6), chunks(9)]))
    (original,) = loaders(tmp_path, world_size=1, grad_accum_steps=2, shuffle=shuffle, seed=3)
    states_at(position, original, where)
    state = original.state_dict()
    (resumed,) = loaders(tmp_path, world_size=1, grad_accum_steps=2, shuffle=shuffle, seed=3)
    resumed.load_state_dict(state)
    start_epoch = original.epoch
    for i in range(24):  # past the next shard change and into the next epoch (20 chunks an epoch)
        x, y = original.next_batch()
        x2, y2 = resumed.next_batch()
        assert torch.equal(x, x2) and torch.equal(y, y2), i
    assert resumed.state_dict() == original.state_dict() and original.epoch == start_epoch + 1


@pytest.mark.parametrize("shuffle", [False, True], ids=["in_order", "shuffled"])
@pytest.mark.parametrize("position", ["mid_shard", "shard_boundary"])
def test_two_rank_state_resumes_on_one_rank_at_the_next_global_step(tmp_path, position, shuffle):
    where = Chunks(make_shards(tmp_path, "train", [chunks(7), chunks(6), chunks(9)]))
    ranks = loaders(tmp_path, world_size=2, grad_accum_steps=1, shuffle=shuffle, seed=3)  # 2 chunks a step
    for _ in range(2):  # 4 chunks in: mid-shard, every shard has at least 6
        global_step(ranks, 1, where)
    while position == "shard_boundary" and ranks[0].shard_position == 0:
        global_step(ranks, 1, where)
    state = ranks[0].state_dict()
    assert ranks[1].state_dict() == state
    expected = (0, 4) if position == "mid_shard" else (1, 0)
    assert (state["shard_position"], state["chunk_position"]) == expected
    (single,) = loaders(tmp_path, world_size=1, grad_accum_steps=2, shuffle=shuffle, seed=3)
    single.load_state_dict(state)
    for step in range(10):  # the 1-rank loader's two micro-steps read rank 0's chunk, then rank 1's
        assert global_step([single], 2, where) == [[c[0] for c in global_step(ranks, 1, where)]], step


def test_loading_a_state_from_another_batch_shape_or_total_batch_raises(tmp_path):
    make_shards(tmp_path, "train", [chunks(8)])
    state = DistributedDataLoader(tmp_path, "train", B, T, grad_accum_steps=2).state_dict()
    other_chunk = DistributedDataLoader(tmp_path, "train", B, 2 * T, grad_accum_steps=2)
    with pytest.raises(UserError, match=r"chunk_tokens=8.*chunk_tokens=16"):
        other_chunk.load_state_dict(state)
    other_total = DistributedDataLoader(tmp_path, "train", B, T, grad_accum_steps=4)
    with pytest.raises(UserError, match=r"chunks_per_step=2.*chunks_per_step=4"):
        other_total.load_state_dict(state)
    other_seed = DistributedDataLoader(tmp_path, "train", B, T, grad_accum_steps=2, seed=1)
    with pytest.raises(UserError, match=r"seed=0.*seed=1"):
        other_seed.load_state_dict(state)


def test_a_state_from_other_shards_or_another_seq_len_is_refused_naming_both(tmp_path):
    make_shards(tmp_path / "data", "train", [chunks(8), chunks(8)])
    state = DistributedDataLoader(tmp_path / "data", "train", B, T, grad_accum_steps=2).state_dict()
    # The same shards elsewhere (the data moved to another disk) resume.
    shutil.copytree(tmp_path / "data", tmp_path / "copy")
    DistributedDataLoader(tmp_path / "copy", "train", B, T, grad_accum_steps=2).load_state_dict(state)
    # As many shards, but other ones: another data set.
    make_shards(tmp_path / "other", "train", [chunks(8), chunks(9)])
    with pytest.raises(UserError) as raised:
        DistributedDataLoader(tmp_path / "other", "train", B, T, grad_accum_steps=2).load_state_dict(state)
    assert f"--data_dir {tmp_path / 'data'}" in str(raised.value)
    assert f"--data_dir {tmp_path / 'other'}" in str(raised.value)
    # The same B·T tokens a chunk, cut into 4 sequences of 2 tokens instead of 2 of 4.
    with pytest.raises(UserError, match="--seq_len 4, and this run into sequences of --seq_len 2"):
        DistributedDataLoader(tmp_path / "data", "train", 2 * B, T // 2, grad_accum_steps=2).load_state_dict(state)


def epochs(data_dir: Path, n: int, where: Chunks, **kw) -> list[list[tuple]]:
    """The chunks a 1-rank loader reads in each of its first n epochs (2 chunks a step)."""
    (loader,) = loaders(data_dir, world_size=1, grad_accum_steps=2, **kw)
    out = [[] for _ in range(n)]
    while loader.epoch < n:
        epoch = loader.epoch
        out[epoch].append(where.locate(*loader.next_batch()))
    return out


def test_shuffle_is_a_fresh_permutation_each_epoch_and_seed(tmp_path):
    where = Chunks(make_shards(tmp_path, "train", [chunks(6), chunks(4), chunks(8)]))  # no leftovers: 18 chunks
    (in_order,) = epochs(tmp_path, 1, where)
    seed1 = epochs(tmp_path, 2, where, shuffle=True, seed=1)
    assert epochs(tmp_path, 2, where, shuffle=True, seed=1) == seed1  # deterministic
    (seed2_epoch0,) = epochs(tmp_path, 1, where, shuffle=True, seed=2)
    assert len(in_order) == 18 and len(set(in_order)) == 18
    for order in (*seed1, seed2_epoch0):
        assert sorted(order) == sorted(in_order)  # each epoch reads every chunk exactly once
        assert order != in_order
    assert seed1[0] != seed1[1]
    for shard in range(3):  # within each shard, too, the chunk order changes from epoch to epoch
        assert [c for c in seed1[0] if c[0] == shard] != [c for c in seed1[1] if c[0] == shard]
    assert seed1[0] != seed2_epoch0
    # The shard order is shuffled too, not only the chunks within a shard (3 shards: 1 in 6 orders is the identity).
    shard_orders = [list(dict.fromkeys(s for s, _ in order)) for order in (*seed1, seed2_epoch0)]
    assert shard_orders[0] != shard_orders[1] and any(o != [0, 1, 2] for o in shard_orders)


# Each case: what the error says, besides the file's name.
BAD_FILE_CASES = {
    "missing_directory": "does not exist",
    "no_matching_shards": "no train shards",
    "bad_magic": "bad magic number 1234",
    "bad_version": "unsupported shard version 2",
    "shorter_than_header_claims": "header says 32 tokens",
    "longer_than_header_claims": "header says 32 tokens",
    "shorter_than_header": "shorter than the 1024-byte shard header",
    "too_small_for_a_step": "fewer than one optimizer step needs",
    "directory_named_like_a_shard": "is a directory",
}


@pytest.mark.parametrize("case", BAD_FILE_CASES)
def test_bad_shard_files_fail_with_an_error_naming_the_file(tmp_path, case):
    data_dir = tmp_path / "data"
    make_shards(data_dir, "train", [chunks(4)])  # a good first shard, so the error must name the bad one
    bad = data_dir / "test_train_000001.bin"
    write_shard(bad, np.arange(32))
    if case == "missing_directory":
        data_dir = bad = tmp_path / "nowhere"
    elif case == "no_matching_shards":
        data_dir = bad = tmp_path / "other"
        make_shards(data_dir, "val", [chunks(4)])  # right format, wrong split
        (data_dir / "train_notes.txt").write_text("not a shard")
    elif case == "bad_magic":
        with open(bad, "r+b") as f:
            f.write(np.array([1234], dtype="<i4").tobytes())
    elif case == "bad_version":
        with open(bad, "r+b") as f:
            f.seek(4)
            f.write(np.array([2], dtype="<i4").tobytes())
    elif case == "shorter_than_header_claims":
        bad.write_bytes(bad.read_bytes()[:-2])  # one token missing
    elif case == "longer_than_header_claims":
        bad.write_bytes(bad.read_bytes() + b"\0\0")
    elif case == "shorter_than_header":
        bad.write_bytes(bad.read_bytes()[:100])
    elif case == "too_small_for_a_step":
        write_shard(bad, np.arange(2 * B * T))  # a step of 2 chunks needs 2·8 + 1 = 17 tokens
    elif case == "directory_named_like_a_shard":
        bad.unlink()
        bad.mkdir()
    with pytest.raises(UserError) as raised:
        DistributedDataLoader(data_dir, "train", B, T, grad_accum_steps=2)
    assert str(bad) in str(raised.value) and BAD_FILE_CASES[case] in str(raised.value)


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_token_id_outside_the_models_vocabulary_fails_at_once_naming_the_shard_and_where(tmp_path, split):
    make_shards(tmp_path, split, [chunks(4)], vocab=100)  # a good first shard, so the error must name the bad one
    tokens = np.arange(chunks(4)) % 100
    tokens[21] = 100
    bad = tmp_path / f"test_{split}_000001.bin"
    write_shard(bad, tokens)
    with pytest.raises(UserError) as raised:
        DistributedDataLoader(tmp_path, split, B, T, vocab_size=100)
    assert f"{bad}: token id 100 at position 21 is not in the model's vocabulary of 100" in str(raised.value)
    DistributedDataLoader(tmp_path, split, B, T, vocab_size=101)  # id 100 fits a vocabulary of 101


def test_shard_with_exactly_one_step_of_tokens_is_accepted(tmp_path):
    where = Chunks(make_shards(tmp_path, "train", [2 * B * T + 1]))
    loader = DistributedDataLoader(tmp_path, "train", B, T, grad_accum_steps=2)
    assert [where.locate(*loader.next_batch()) for _ in range(3)] == [(0, 0), (0, 8), (0, 0)]


def test_write_shard_writes_the_llm_c_format(tmp_path):
    path = tmp_path / "x_train_000000.bin"
    write_shard(path, np.array([0, 1, 50256, 65535]))
    header = np.fromfile(path, dtype="<i4", count=3)
    assert header.tolist() == [MAGIC, VERSION, 4] == [20240520, 1, 4]
    assert path.stat().st_size == HEADER_BYTES + 4 * 2 == 1032
    assert np.fromfile(path, dtype="<u2", offset=HEADER_BYTES).tolist() == [0, 1, 50256, 65535]
    assert read_shard_header(path) == 4


@pytest.mark.parametrize("tokens", [[1, 65536], [-1, 2]])
def test_write_shard_rejects_ids_outside_uint16_and_leaves_no_file(tmp_path, tokens):
    path = tmp_path / "x_train_000000.bin"
    with pytest.raises(ValueError, match=re.escape(str(path))):
        write_shard(path, np.array(tokens))
    assert list(tmp_path.iterdir()) == []  # neither the shard nor a .tmp


def test_the_loader_reads_just_the_tokens_of_each_batch_with_plain_reads(tmp_path, monkeypatch):
    """No memory map (a shard truncated under it would be SIGBUS), and no whole shard in memory either."""
    make_shards(tmp_path, "train", [chunks(2), chunks(2)])
    loader = DistributedDataLoader(tmp_path, "train", B, T)
    reads = []
    real_read = dataloader.Shard.read

    def read(shard, start, count):
        reads.append((shard.path.name, start, count))
        return real_read(shard, start, count)

    monkeypatch.setattr(dataloader.Shard, "read", read)
    for _ in range(3):  # on to the second shard
        loader.next_batch()
    assert reads == [("test_train_000000.bin", 0, B * T + 1), ("test_train_000000.bin", B * T, B * T + 1),
                     ("test_train_000001.bin", 0, B * T + 1)]
    assert not any(isinstance(value, np.memmap) for value in vars(loader).values())


def truncate_shard(path: Path, tokens: int) -> None:
    """Cut a shard down to its header and `tokens` tokens in place, as a copy over it would, mid-way."""
    os.truncate(path, HEADER_BYTES + 2 * tokens)


@pytest.mark.parametrize("align_bos", [False, True], ids=["plain", "aligned"])
def test_a_shard_truncated_under_the_loader_is_an_error_naming_it_and_the_position_stays_at_the_step(tmp_path,
                                                                                                     align_bos):
    make_document_shards(tmp_path, "train", ROW, [chunks(6), chunks(6)], seed=2)
    shards = sorted(tmp_path.iterdir())
    (loader,) = loaders(tmp_path, world_size=1, grad_accum_steps=2, align_bos=align_bos)
    loader.read_ahead()  # step 0 (in memory already: what a truncation now does not change)
    before = loader.state_dict()
    truncate_shard(shards[1], 3)  # the next shard: under --align_bos it is read whole when it is opened
    truncate_shard(shards[0], 3 * B * T)  # the step after next is past the end
    step_0 = [loader.next_batch() for _ in range(2)]
    assert loader.state_dict()["chunk_position"] == 2 != before["chunk_position"]
    with pytest.raises(dataloader.ShardReadError) as failed:
        loader.read_ahead()
    expected = HEADER_BYTES + 2 * chunks(6)
    truncated = shards[1] if align_bos else shards[0]
    size = truncated.stat().st_size
    if align_bos:  # opened, and seen to be cut short (ShardWatch) before it is read whole
        assert str(failed.value) == (f"{truncated}: the shard is now {size:,} bytes, not the {expected:,} it had when "
                                     "the run started: it was truncated, appended to or rewritten in place.")
    else:  # being read: the read comes back short
        assert str(failed.value).startswith(f"{truncated}: the shard is now {size:,} bytes, shorter than the "
                                            f"{expected:,} ({chunks(6):,} tokens) it had when the run started, so "
                                            "tokens ")
        assert str(failed.value).endswith("it was truncated or rewritten in place while the run read it.")
    assert isinstance(failed.value, UserError)
    # A snapshot now resumes at step 1, all of whose batches are then read again.
    state = loader.state_dict()
    assert state == {**before, "chunk_position": 2}
    for path, tokens in zip(shards, make_document_shards(tmp_path / "whole", "train", ROW, [chunks(6)] * 2,
                                                         seed=2)[0]):
        dataloader.write_shard(path, tokens)  # the shards restored
    (resumed,) = loaders(tmp_path, world_size=1, grad_accum_steps=2, align_bos=align_bos)
    resumed.load_state_dict(state)
    (uninterrupted,) = loaders(tmp_path, world_size=1, grad_accum_steps=2, align_bos=align_bos)
    expected_batches = [uninterrupted.next_batch() for _ in range(6)]
    assert all(torch.equal(a, b) for got, want in zip(step_0, expected_batches[:2]) for a, b in zip(got, want))
    for want in expected_batches[2:]:
        assert all(torch.equal(a, b) for a, b in zip(resumed.next_batch(), want))


@pytest.mark.parametrize("align_bos", [False, True], ids=["plain", "aligned"])
def test_read_ahead_hands_out_the_same_batches_and_keeps_the_position_until_it_has(tmp_path, align_bos):
    make_document_shards(tmp_path, "train", ROW, [chunks(6), chunks(9)])
    plain_ranks = loaders(tmp_path, world_size=2, grad_accum_steps=2, shuffle=True, align_bos=align_bos)
    ahead_ranks = loaders(tmp_path, world_size=2, grad_accum_steps=2, shuffle=True, align_bos=align_bos)
    for step in range(8):  # over shard changes and into epoch 1
        for plain, ahead in zip(plain_ranks, ahead_ranks):
            position = ahead.state_dict()
            ahead.read_ahead()
            ahead.read_ahead()  # (a second call reads nothing more)
            assert ahead.state_dict() == position == plain.state_dict()
            for _ in range(2):
                assert all(torch.equal(a, b) for a, b in zip(ahead.next_batch(), plain.next_batch())), step
            assert ahead.state_dict() == plain.state_dict()
    assert plain_ranks[0].epoch >= 1


# --- document-aligned batches (align_bos)

ROW = T + 1  # an aligned row: T inputs and the one more target


def aligned_loaders(data_dir: Path, world_size: int, grad_accum_steps: int, **kw) -> list[DistributedDataLoader]:
    return loaders(data_dir, world_size, grad_accum_steps, align_bos=True, **kw)


def test_pack_rows_best_fit_by_hand():
    #          0    1  2  3    4  5  6  7  8  9  10 11   12 13   14 15 16
    tokens = [EOT, 1, 1, EOT, 2, 2, 2, 2, 2, 2, 2, EOT, 3, EOT, 4, 4, 4]  # documents of 3, 8, 2, 3 tokens
    rows, cropped = pack_rows(np.array(tokens), 5, EOT)
    # The 8-token document: a row of its first 5, and its tail (9, 3 tokens) fills the end of a row; rows start
    # with the largest document that fits (ties: the later one), then the largest that fits what is left, else the
    # shortest cropped; the shard's leading EOT and the tail's last token are cropped.
    assert [row.tolist() for row in rows] == [[[4, 5]], [[14, 3], [12, 2]], [[1, 3], [9, 2]]]
    assert cropped == 2
    # Without splitting long documents, the 8-token one is cropped to 2 and the rest of it lost.
    rows, cropped = pack_rows(np.array(tokens), 5, EOT, split_long=False)
    assert [row.tolist() for row in rows] == [[[14, 3], [12, 2]], [[1, 3], [4, 2]]] and cropped == 7


def test_aligned_rows_start_at_document_starts_or_continue_a_long_one(tmp_path):
    arrays, starts = make_document_shards(tmp_path, "train", ROW, [3000, 2000])
    (loader,) = aligned_loaders(tmp_path, world_size=1, grad_accum_steps=1)
    seen, rows = set(), 0
    while loader.epoch == 0:
        x, y = loader.next_batch()
        assert x.shape == y.shape == (B, T) and torch.equal(x[:, 1:], y[:, :-1])
        for row in torch.cat([x, y[:, -1:]], dim=1).tolist():
            shard = row[0] // 10_000
            document_starts = set((starts[shard] + 10_000 * shard).tolist())
            for i in range(1, ROW):  # a document's last token is the next one's EOT: its position, or (a tail of
                if row[i] == EOT:    # only the EOT) a negative one of its own
                    row[i] = row[i - 1] + 1 if row[i - 1] + 2 in document_starts else -i
            runs = np.split(np.array(row), np.flatnonzero(np.diff(row) != 1) + 1)  # maximal runs of positions
            for i, run in enumerate(runs):
                if run[0] in document_starts or (run[0] < 0 and i > 0):
                    continue
                first = max(s for s in document_starts if s < run[0])
                assert (run[0] - first) % ROW == 0, (row, "starts mid-document, not at a row-sized piece")
                assert i > 0 or len(runs) == 1, (row, "a long document's continuation starts a row it shares")
            assert row[0] in document_starts or len(runs) == 1  # a row starts a document, or continues one whole
            row = [t for t in row if t >= 0]
            assert seen.isdisjoint(row)  # no token read twice in an epoch
            seen |= set(row)
            rows += 1
    counts = [(len(a), pack_rows(a, ROW, EOT)[1]) for a in arrays]
    packed = sum(n - cropped for n, cropped in counts)
    assert packed >= rows * ROW >= packed - len(arrays) * B * ROW  # all but each shard's leftover part of a chunk


@pytest.mark.parametrize("shuffle", [False, True], ids=["in_order", "shuffled"])
def test_aligned_batches_of_two_ranks_are_the_one_rank_batches(tmp_path, shuffle):
    make_document_shards(tmp_path, "train", ROW, [2000, 1500])
    k = 2
    ranks = aligned_loaders(tmp_path, world_size=2, grad_accum_steps=k, shuffle=shuffle, seed=4)
    (single,) = aligned_loaders(tmp_path, world_size=1, grad_accum_steps=2 * k, shuffle=shuffle, seed=4)
    for step in range(150):  # over 2 epochs
        per_rank = [[loader.next_batch() for _ in range(k)] for loader in ranks]
        for j in range(2 * k):  # the 1-rank micro-step j is rank j % 2's micro-step j // 2
            x, y = single.next_batch()
            x2, y2 = per_rank[j % 2][j // 2]
            assert torch.equal(x, x2) and torch.equal(y, y2), (step, j)
        assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()
    assert single.epoch >= 2


@pytest.mark.parametrize("shuffle", [False, True], ids=["in_order", "shuffled"])
def test_aligned_loader_resumed_mid_epoch_gives_the_uninterrupted_batches(tmp_path, shuffle):
    make_document_shards(tmp_path, "train", ROW, [2000, 1500])
    (original,) = aligned_loaders(tmp_path, world_size=1, grad_accum_steps=2, shuffle=shuffle, seed=3)
    for _ in range(30):
        original.next_batch()
    state = original.state_dict()
    assert state["align_bos"] == 1 and state["epoch"] == 0 and state["chunk_position"] > 0
    (resumed,) = aligned_loaders(tmp_path, world_size=1, grad_accum_steps=2, shuffle=shuffle, seed=3)
    resumed.load_state_dict(state)
    for i in range(300):  # into the next epoch
        x, y = original.next_batch()
        x2, y2 = resumed.next_batch()
        assert torch.equal(x, x2) and torch.equal(y, y2), i
    assert resumed.state_dict() == original.state_dict() and original.epoch >= 1
    (unaligned,) = loaders(tmp_path, world_size=1, grad_accum_steps=2, shuffle=shuffle, seed=3)
    with pytest.raises(UserError, match="align_bos=1, this run has align_bos=0"):
        unaligned.load_state_dict(state)
