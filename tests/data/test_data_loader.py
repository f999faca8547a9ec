import msgpack
import numpy as np
import pytest
import torch

from mff.data import Loader, PackedTokens, eval_batches, split_microbatches

T = 4


def make_data(n_windows: int, eod_id: int = 10_000) -> PackedTokens:
    # token k == k, so window i starts with token i*T: easy to read back which window came out
    return PackedTokens(np.arange(n_windows * T + 1, dtype=np.int64), T, eod_id)


def window_ids(batch) -> list[int]:
    return (batch["input_ids"][:, 0] // T).tolist()


def expected_stream(n: int, seed: int, count: int, shuffle: bool = True) -> list[int]:
    out: list[int] = []
    e = 0
    while len(out) < count:
        if shuffle:
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + e)).tolist()
        else:
            perm = list(range(n))
        out += perm
        e += 1
    return out[:count]


def test_batch_contents_shapes_and_dtypes():
    data = make_data(5)
    b = Loader(data, batch_size=2, seed=0, shuffle=False).next_batch()
    assert set(b) == {"input_ids", "labels", "document_ids"}
    for v in b.values():
        assert v.dtype == torch.int64 and v.shape == (2, T)
    assert b["input_ids"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert b["labels"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert b["document_ids"].tolist() == [[0] * T, [0] * T]


def test_unshuffled_epochs_wrap_and_straddle():
    data = make_data(5)
    loader = Loader(data, batch_size=3, seed=0, shuffle=False)
    got = [window_ids(loader.next_batch()) for _ in range(4)]
    assert got == [[0, 1, 2], [3, 4, 0], [1, 2, 3], [4, 0, 1]]
    assert loader.state_dict()["position"] == 12


def test_shuffled_stream_matches_definition_and_is_deterministic():
    data = make_data(7)
    a = Loader(data, batch_size=4, seed=123)
    b = Loader(data, batch_size=4, seed=123)
    got_a = sum((window_ids(a.next_batch()) for _ in range(6)), [])
    got_b = sum((window_ids(b.next_batch()) for _ in range(6)), [])
    assert got_a == got_b == expected_stream(7, 123, 24)
    # each epoch is a permutation of all windows
    assert sorted(got_a[:7]) == list(range(7)) and sorted(got_a[7:14]) == list(range(7))
    # epochs differ from each other, and other seeds give other streams
    assert got_a[:7] != got_a[7:14]
    c = Loader(data, batch_size=4, seed=124)
    assert sum((window_ids(c.next_batch()) for _ in range(6)), []) != got_a


def test_resume_gives_same_batches_as_uninterrupted():
    data = make_data(9)
    ref = Loader(data, batch_size=4, seed=5)
    ref_batches = [ref.next_batch() for _ in range(8)]

    first = Loader(data, batch_size=4, seed=5)
    for _ in range(3):
        first.next_batch()
    state = msgpack.unpackb(msgpack.packb(first.state_dict()))  # survives serialisation
    assert state == {"position": 12, "seed": 5, "num_samples": 9, "shuffle": 1}

    resumed = Loader(data, batch_size=4, seed=5)
    resumed.load_state_dict(state)
    for want in ref_batches[3:]:
        got = resumed.next_batch()
        for k in want:
            assert torch.equal(got[k], want[k])


def test_resume_rejects_a_different_stream():
    data = make_data(9)
    loader = Loader(data, batch_size=4, seed=5)
    with pytest.raises(ValueError, match="seed"):
        loader.load_state_dict({"position": 4, "seed": 6})
    with pytest.raises(ValueError, match="num_samples"):
        loader.load_state_dict({"position": 4, "num_samples": 10})
    loader.load_state_dict({"position": 4})
    assert loader.position == 4


def test_dp_ranks_together_make_the_global_batch():
    data = make_data(11)
    glob = Loader(data, batch_size=6, seed=3)
    ranks = [Loader(data, batch_size=6, seed=3, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(5):  # crosses epoch boundaries (11 windows)
        want = glob.next_batch()
        parts = [r.next_batch() for r in ranks]
        assert parts[0]["input_ids"].shape == (3, T)
        for k in want:
            assert torch.equal(torch.cat([p[k] for p in parts]), want[k])
    assert all(r.state_dict()["position"] == 30 for r in ranks)


def test_dp_resume_on_other_world_size():
    data = make_data(11)
    two = [Loader(data, batch_size=4, seed=1, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(3):
        for r in two:
            r.next_batch()
    single = Loader(data, batch_size=4, seed=1)
    single.load_state_dict(two[0].state_dict())
    assert window_ids(single.next_batch()) == expected_stream(11, 1, 16)[12:16]


def test_loader_argument_errors():
    data = make_data(4)
    with pytest.raises(ValueError, match="batch_size 6 is not divisible by dp_size 4"):
        Loader(data, batch_size=6, seed=0, dp_size=4)
    with pytest.raises(ValueError, match="dp_rank"):
        Loader(data, batch_size=4, seed=0, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        Loader(data, batch_size=0, seed=0)


def test_document_ids_in_batches():
    # EOD = 0 at tokens 2 and 5 in stream [3,4,0,5,6,0,7,8,9]
    data = PackedTokens(np.array([3, 4, 0, 5, 6, 0, 7, 8, 9]), 4, eod_id=0)
    b = Loader(data, batch_size=2, seed=0, shuffle=False).next_batch()
    assert b["input_ids"].tolist() == [[3, 4, 0, 5], [6, 0, 7, 8]]
    assert b["labels"].tolist() == [[4, 0, 5, 6], [0, 7, 8, 9]]
    assert b["document_ids"].tolist() == [[0, 0, 0, 1], [0, 0, 1, 1]]


def test_split_microbatches():
    data = make_data(8)
    batch = Loader(data, batch_size=6, seed=0, shuffle=False).next_batch()
    micro = split_microbatches(batch, 3)
    assert len(micro) == 3
    assert [window_ids(m) for m in micro] == [[0, 1], [2, 3], [4, 5]]
    for k in batch:
        assert torch.equal(torch.cat([m[k] for m in micro]), batch[k])
    with pytest.raises(ValueError, match="batch size 6 is not divisible into 4 micro-batches"):
        split_microbatches(batch, 4)


def test_eval_batches_in_order_and_short_split():
    data = make_data(7)
    bs = eval_batches(data, batch_size=2, n_batches=2)
    assert [window_ids(b) for b in bs] == [[0, 1], [2, 3]]
    bs = eval_batches(data, batch_size=2, n_batches=100)  # only whole batches: 3
    assert [window_ids(b) for b in bs] == [[0, 1], [2, 3], [4, 5]]
    bs = eval_batches(data, batch_size=10, n_batches=3)  # fewer windows than a batch: one batch of all
    assert [window_ids(b) for b in bs] == [list(range(7))]
