"""The pieces of the combination runs (tests/test_combinations.py), importable by a run's
config as ``module: tests.combo``.

- :class:`NoisyBlobs`: a 3-class set whose ``__getitem__`` adds noise from the global torch
  RNG, so a resume is exact with loader workers only if every sample is seeded the same.
- :class:`StreamBlobs`: the same samples as a stream (:class:`echelon3.data.streams.Stream`),
  each carrying its id as a fifth column; its noise comes from the stream's per-sample
  generator.
- :class:`ComboNet`: a small MLP with dropout (the training process's RNG matters), a
  parameter that never gets a gradient (momentum and weight decay must leave it alone), and
  a persistent counter of training forwards, saved with the weights, that plants a NaN
  (rank 0's output at forward ``$COMBO_NAN_AT``) and sends rank 0 a signal at forward
  ``$COMBO_SIGNAL_AT`` (``$COMBO_SIGNAL``: USR1 or KILL), once: ``$COMBO_MARKER`` is
  created first, so the resumed attempt does not signal again. Given a fifth column (a
  :class:`StreamBlobs` id) it strips it and, with ``$COMBO_IDS``, appends the ids of each
  training batch to ``$COMBO_IDS.<rank>``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from echelon3.data.streams import Stream


class NoisyBlobs(torch.utils.data.Dataset):
    def __init__(self, size: int = 48, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.arange(size) % 3
        centres = torch.randn(3, 4, generator=g) * 2
        self.inputs = centres[self.labels] + 0.5 * torch.randn(size, 4, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index):
        return self.inputs[index] + 0.1 * torch.randn(4), self.labels[index]


class StreamBlobs(Stream):
    def __init__(self, size: int = 48, seed: int = 0):
        super().__init__(seed)
        self.blobs = NoisyBlobs(size, seed)

    def __len__(self) -> int:
        """This rank's samples in a pass: the trainer then knows the epoch's length (and
        ``total_steps``), as for the map-style set."""
        return len(self.blobs) // (self.world_size or 1)

    def __iter__(self):
        for index in self.shard(self.order(len(self.blobs))):
            noise = 0.1 * torch.randn(4, generator=self.generator)
            features = self.blobs.inputs[index] + noise
            yield torch.cat([features, torch.tensor([float(index)])]), self.blobs.labels[index]


class ComboNet(torch.nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(),
                                        torch.nn.Dropout(0.2), torch.nn.Linear(hidden, 3))
        self.spare = torch.nn.Linear(2, 2)  # never used: its gradient stays None
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        ids, x = (x[:, 4], x[:, :4]) if x.shape[1] == 5 else (None, x)
        out = self.body(x)
        if not self.training:
            return out
        if ids is not None and os.environ.get("COMBO_IDS"):
            with open(f"{os.environ['COMBO_IDS']}.{os.environ.get('RANK', 0)}", "a") as f:
                f.write("".join(f"{int(i)}\n" for i in ids.tolist()))
        self.calls += 1
        calls, rank0 = int(self.calls), int(os.environ.get("RANK", 0)) == 0
        if rank0 and calls == int(os.environ.get("COMBO_NAN_AT", 0)):
            out = out * float("nan")
        marker = os.environ.get("COMBO_MARKER")
        if rank0 and calls == int(os.environ.get("COMBO_SIGNAL_AT", 0)) and marker \
                and not Path(marker).exists():
            Path(marker).touch()
            os.kill(os.getpid(), getattr(signal, f"SIG{os.environ['COMBO_SIGNAL']}"))
        return out
