"""Training data: the global batch of step k is a fixed function of (source, seed, k), independent of
the plan; each data-parallel rank takes its contiguous slice and the pipeline/loop splits it into
micro-batches. Batches are [rows, seq_len + 1] token ids: inputs are [:, :-1], targets [:, 1:]."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from meshplan.planner.errors import InputError

DATA_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class SyntheticData:
    """Deterministic, learnable stream: each sequence is an arithmetic progression modulo the vocabulary
    with a random start and a random stride in 1..8, so the loss falls quickly from log(vocab)."""

    def __init__(self, vocab_size: int, seq_len: int, global_batch: int, seed: int):
        self.vocab_size, self.seq_len, self.global_batch, self.seed = vocab_size, seq_len, global_batch, seed

    def batch(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        start = torch.randint(0, self.vocab_size, (self.global_batch, 1), generator=gen)
        stride = torch.randint(1, 9, (self.global_batch, 1), generator=gen)
        pos = torch.arange(self.seq_len + 1)[None, :]
        return (start + stride * pos) % self.vocab_size

    def position(self, step: int) -> int:
        return step * self.global_batch * self.seq_len


class TokenFile:
    """A flat binary file of token ids (nanoGPT's train.bin), read through a numpy memmap. Step k reads
    the global batch's rows one after another from token offset k * global_batch * seq_len, wrapping."""

    def __init__(self, path: str, dtype: str, vocab_size: int, seq_len: int, global_batch: int):
        if not os.path.isfile(path):
            raise InputError(f"--data: no such file '{path}'")
        itemsize = np.dtype(DATA_DTYPES[dtype]).itemsize
        if os.path.getsize(path) % itemsize:
            raise InputError(f"--data: size of '{path}' is not a multiple of {itemsize} bytes ({dtype})")
        self.tokens = np.memmap(path, dtype=DATA_DTYPES[dtype], mode="r")
        if len(self.tokens) < seq_len + 1:
            raise InputError(f"--data: '{path}' holds {len(self.tokens)} tokens, fewer than seq_len + 1 "
                             f"= {seq_len + 1}")
        self.path, self.vocab_size, self.seq_len, self.global_batch = path, vocab_size, seq_len, global_batch
        self.windows = (len(self.tokens) - 1) // seq_len  # non-overlapping windows of seq_len (+1 target)

    def batch(self, step: int) -> torch.Tensor:
        first = step * self.global_batch
        rows = []
        for i in range(self.global_batch):
            w = (first + i) % self.windows
            rows.append(np.asarray(self.tokens[w * self.seq_len: w * self.seq_len + self.seq_len + 1], dtype=np.int64))
        out = torch.from_numpy(np.stack(rows))
        if int(out.max()) >= self.vocab_size:
            raise InputError(f"--data: token id {int(out.max())} in '{self.path}' is >= the model's vocab_size "
                             f"{self.vocab_size}")
        return out

    def position(self, step: int) -> int:
        return (step * self.global_batch % self.windows) * self.seq_len


@dataclass
class Shard:
    """This rank's part of each global batch."""

    source: SyntheticData | TokenFile
    dp_rank: int
    rows: int  # micro_batch_size * num_micro_batches

    def inputs_targets(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.source.batch(step)[self.dp_rank * self.rows:(self.dp_rank + 1) * self.rows]
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
