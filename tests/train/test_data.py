"""Training data: the synthetic corpus, text files, shards and exact state round trips."""
import pytest
import torch

from moe_plugin.train.data import PATTERN_SYMBOLS, TOPICS, DataConfig, check_config, decode, make_data


def take(batches, n):
    return [batches.next() for _ in range(n)]


@pytest.mark.parametrize("source", ["synthetic", "text file", "synthetic, at a line end"])
def test_state_dict_resumes_the_stream_exactly(tmp_path, fresh_seed, source):
    path = None
    if source == "text file":
        path = tmp_path / "corpus.txt"
        path.write_bytes(bytes(torch.randint(0, 256, (5000,)).tolist()))
    cfg = DataConfig(path=None if path is None else str(path), seed=fresh_seed)
    data = make_data(cfg, batch_size=3, seq_len=17, val_batches=2)
    take(data.train, 2)
    if source.endswith("at a line end"):
        data.train.pending.clear()          # nothing left over from the last line
    torch.save(data.train.state_dict(), tmp_path / "state.pt")    # as a checkpoint holds it
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    expected = take(data.train, 3)
    again = make_data(cfg, batch_size=3, seq_len=17, val_batches=2)
    again.train.load_state_dict(state)
    for (x, y), (x2, y2) in zip(expected, take(again.train, 3)):
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert x.shape == (3, 17) and torch.equal(x[:, 1:], y[:, :-1])


def test_ranks_read_distinct_shards_and_share_validation(fresh_seed):
    cfg = DataConfig(seed=fresh_seed)
    rank0, rank1 = (make_data(cfg, 4, 64, 2, rank=r, world_size=2) for r in (0, 1))
    assert not torch.equal(rank0.train.next()[0], rank1.train.next()[0])
    assert all(torch.equal(a[0], b[0]) for a, b in zip(rank0.val, rank1.val))


def test_synthetic_topics_have_their_own_alphabets(fresh_seed):
    topics = make_data(DataConfig(seed=fresh_seed), 4, 128, 1).topics
    assert set(topics) == set(TOPICS)
    text = {topic: set(decode(x_BS.flatten())) - {"\n", " "} for topic, x_BS in topics.items()}
    assert text["arithmetic"] <= set("0123456789+-=")
    assert text["pattern"] <= set(PATTERN_SYMBOLS)
    assert text["lower_words"] <= set("abcdefghijklmnopqrstuvwxyz.")
    assert text["upper_words"] <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZ!")


def test_text_file_validation_is_held_out(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"a" * 900 + b"z" * 100)
    data = make_data(DataConfig(path=str(path), val_fraction=0.1), batch_size=2, seq_len=8, val_batches=3)
    assert all(set(decode(x.flatten())) == {"z"} for x, _ in data.val)
    assert all(set(decode(data.train.next()[0].flatten())) == {"a"} for _ in range(5))
    with pytest.raises(ValueError, match="is too short"):
        make_data(DataConfig(path=str(path)), batch_size=2, seq_len=200, val_batches=1)


def test_bad_data_config():
    with pytest.raises(ValueError, match="data.path='/no/such' is invalid: no such file"):
        check_config(DataConfig(path="/no/such"))
    with pytest.raises(ValueError, match="data.val_fraction=1.5 is invalid"):
        check_config(DataConfig(val_fraction=1.5))
