"""The language-model data of `moe-plugin train` (data.task: lm): bytes as tokens, from a seeded synthetic corpus
or a text file.

Legend: B batch rows, S sequence length. A batch is (x_BS, y_BS): y is x shifted by one byte.

Every source of randomness is a generator owned by the batch stream, so state_dict() /
load_state_dict() resume it exactly. Rank r of a multi-process run reads its own shard.
"""
from __future__ import annotations

import random
from typing import Optional

import torch

from .batches import Batch, Data

VOCAB_SIZE = 256
TOPICS = ("arithmetic", "pattern", "lower_words", "upper_words")
PATTERN_SYMBOLS = "#$%&*<>@^~|/"


class SyntheticCorpus:
    """Endless lines from four topics, each with its own alphabet and structure:
    arithmetic ("17+25=42"), repeated symbol patterns ("<#%<#%<#%"), and two word languages
    (lowercase syllables ending in ".", uppercase clusters ending in "!"), each word followed by
    one of a few fixed successors. The languages depend on the seed only, never on the stream.
    """

    def __init__(self, seed: int):
        rng = random.Random(f"{seed}/languages")
        self.lower = _language(rng, lambda: "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou")
                                                    for _ in range(rng.randint(1, 3))))
        self.upper = _language(rng, lambda: "".join(rng.choice("BCDFGHJKLMNPQRSTVWXYZ")
                                                    for _ in range(rng.randint(2, 4))))

    def line(self, rng: random.Random, topic: Optional[str] = None) -> str:
        topic = topic or rng.choice(TOPICS)
        if topic == "arithmetic":
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            return f"{a}+{b}={a + b}\n" if rng.random() < 0.5 else f"{max(a, b)}-{min(a, b)}={abs(a - b)}\n"
        if topic == "pattern":
            unit = "".join(rng.choice(PATTERN_SYMBOLS) for _ in range(rng.randint(2, 5)))
            return unit * rng.randint(3, 8) + "\n"
        words, successors = self.lower if topic == "lower_words" else self.upper
        word = rng.choice(words)
        sentence = [word]
        for _ in range(rng.randint(3, 9)):
            word = rng.choice(successors[word])
            sentence.append(word)
        return " ".join(sentence) + (".\n" if topic == "lower_words" else "!\n")


def _language(rng: random.Random, make_word, size: int = 48, fanout: int = 3):
    words = sorted({make_word() for _ in range(size)})
    return words, {word: rng.sample(words, fanout) for word in words}


class SyntheticBatches:
    """Rows cut one after another from one rank's endless stream of corpus lines."""

    def __init__(self, corpus: SyntheticCorpus, stream: str, batch_size: int, seq_len: int,
                 topic: Optional[str] = None):
        self.corpus, self.topic = corpus, topic
        self.batch_size, self.seq_len = batch_size, seq_len
        self.rng = random.Random(stream)
        self.pending = bytearray()

    def next(self) -> Batch:
        need = self.batch_size * (self.seq_len + 1)
        while len(self.pending) < need:
            self.pending += self.corpus.line(self.rng, self.topic).encode()
        rows_BS1 = torch.frombuffer(self.pending[:need], dtype=torch.uint8).long()
        del self.pending[:need]
        rows_BS1 = rows_BS1.view(self.batch_size, self.seq_len + 1)
        return rows_BS1[:, :-1], rows_BS1[:, 1:]

    def state_dict(self) -> dict:
        # a uint8 tensor, not bytes: torch.load(weights_only=True) refuses an empty bytes object
        return {"rng": self.rng.getstate(), "pending": torch.tensor(list(self.pending), dtype=torch.uint8)}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])
        self.pending = bytearray(state["pending"].tolist())


class WindowBatches:
    """Rows are windows at random offsets in a token buffer (one rank's shard of a text file)."""

    def __init__(self, tokens_N: torch.Tensor, seed: int, batch_size: int, seq_len: int):
        self.tokens_N, self.batch_size, self.seq_len = tokens_N, batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> Batch:
        start_B = torch.randint(0, len(self.tokens_N) - self.seq_len, (self.batch_size,), generator=self.generator)
        rows_BS1 = self.tokens_N[start_B[:, None] + torch.arange(self.seq_len + 1)]
        return rows_BS1[:, :-1], rows_BS1[:, 1:]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def make_text_data(cfg, batch_size: int, seq_len: int, val_batches: int, rank: int = 0, world_size: int = 1) -> Data:
    """data.task='lm': the synthetic corpus (data.path null) or the bytes of a text file."""
    if cfg.path is None:
        corpus = SyntheticCorpus(cfg.seed)
        train = SyntheticBatches(corpus, f"{cfg.seed}/train/{rank}", batch_size, seq_len)
        val_stream = SyntheticBatches(corpus, f"{cfg.seed}/val", batch_size, seq_len)
        topics = {topic: SyntheticBatches(corpus, f"{cfg.seed}/topic", 4, seq_len, topic).next()[0]
                  for topic in TOPICS}
        return Data(train, [val_stream.next() for _ in range(val_batches)], topics)

    with open(cfg.path, "rb") as file:
        tokens_N = torch.frombuffer(bytearray(file.read()), dtype=torch.uint8).long()
    num_val = int(len(tokens_N) * cfg.val_fraction)
    train_N, val_N = tokens_N[:len(tokens_N) - num_val], tokens_N[len(tokens_N) - num_val:]
    shard_N = train_N.tensor_split(world_size)[rank]
    if len(shard_N) <= seq_len or len(val_N) <= seq_len:
        raise ValueError(f"data.path={cfg.path!r} is too short: {len(tokens_N)} bytes leave "
                         f"{len(shard_N)} for training per rank and {len(val_N)} for validation; "
                         f"each needs more than model.seq_len={seq_len}")
    train = WindowBatches(shard_N, cfg.seed * 1_000_003 + rank, batch_size, seq_len)
    rows_RS1 = val_N.unfold(0, seq_len + 1, seq_len)[:val_batches * batch_size]
    val = [(rows_BS1[:, :-1], rows_BS1[:, 1:]) for rows_BS1 in rows_RS1.split(batch_size)]
    return Data(train, val, {})


def decode(x_S: torch.Tensor) -> str:
    return bytes(x_S.to(torch.uint8).tolist()).decode("utf-8", errors="replace")
