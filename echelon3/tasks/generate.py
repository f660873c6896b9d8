"""A ``runner`` for language models: ``echelon3 run`` writes the text the network generates.

Selected in the config's ``runner:`` section; it reads no data set. The prompt is encoded
with the character vocabulary of :mod:`echelon3.datasets.char_text`, the network's own
``generate(idx, max_new_tokens, temperature, top_k, generator)`` (the GPT's) extends it,
and the tokens are decoded back to characters::

    runner:
      module: echelon3.tasks.generate
      type: TextGenerator
      config: {vocab: results/char_text/vocab.json, prompt: "The ", max_new_tokens: 500,
               temperature: 0.8, top_k: 20, seed: 0}

Sample ``s`` of ``samples`` is drawn with a ``torch.Generator`` seeded ``seed + s``, so the
same seed writes the same text. The file (default ``<target.path>/generated.txt``) holds
the samples, prompt included, each after a ``--- sample s (seed n)`` line.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from echelon3.checkpoints.files import atomic_write_text
from echelon3.config.errors import UserError
from echelon3.datasets.char_text import Vocab
from echelon3.distributed.ranks import is_main

log = logging.getLogger(__name__)

KEY = "runner.config"


def _whole(name: str, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise UserError(f"{KEY}.{name}", f"must be a whole number of at least {least}, "
                        f"got {value!r}")
    return value


class TextGenerator:
    """Text the network generates from ``prompt``; injects ``path=`` (target.path).

    ``vocab``: the ``vocab.json`` of the token files the network was trained on;
    ``prompt``: the characters to start from (at least one); ``max_new_tokens``: characters
    added to it; ``temperature``: 0 takes the most likely character, higher flattens the
    distribution; ``top_k``: sample among the k most likely (null: all); ``seed``: the first
    sample's seed; ``samples``: texts written; ``checkpoint``: file to load (default
    best.tar); ``output``: the text file (default ``<target.path>/generated.txt``).
    """

    reads_data = False  # `echelon3 run` builds no data set or loader for it

    def __init__(self, path: str, vocab: str, prompt: str = "\n", max_new_tokens: int = 500,
                 temperature: float = 0.8, top_k: int | None = 20, seed: int = 0,
                 samples: int = 1, checkpoint: str | None = None, output: str | None = None):
        if not Path(vocab).is_file():
            raise UserError(f"{KEY}.vocab", f"no vocabulary file at '{vocab}' (written with "
                            "the token files by `python -m echelon3.datasets.char_text`)")
        self.vocab = Vocab.load(vocab)
        if not isinstance(prompt, str) or not prompt:
            raise UserError(f"{KEY}.prompt", f"must be a text of at least one character, "
                            f"got {prompt!r}")
        lacking = self.vocab.missing(prompt)
        if lacking:
            raise UserError(f"{KEY}.prompt", f"characters not in the vocabulary {vocab}: "
                            f"{''.join(lacking)!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, int | float) \
                or temperature < 0:
            raise UserError(f"{KEY}.temperature", f"must be a number of at least 0, "
                            f"got {temperature!r}")
        self.prompt, self.temperature = prompt, float(temperature)
        self.max_new_tokens = _whole("max_new_tokens", max_new_tokens, 1)
        self.top_k = None if top_k is None else _whole("top_k", top_k, 1)
        self.seed = _whole("seed", seed, 0)
        self.samples = _whole("samples", samples, 1)
        self.checkpoint = checkpoint
        self.output = Path(output) if output else Path(path) / "generated.txt"

    def texts(self, net, device, precision=None) -> list[str]:
        """The ``samples`` texts, prompt included."""
        generate = getattr(net, "generate", None)
        if generate is None:
            raise UserError("runner.type", f"{type(net).__name__} has no generate(idx, "
                            "max_new_tokens, ...) method to generate text with")
        vocab_size = getattr(getattr(net, "tok", None), "num_embeddings", None)
        if vocab_size is not None and vocab_size < len(self.vocab):
            raise UserError(f"{KEY}.vocab", f"holds {len(self.vocab)} characters, more "
                            f"than the network's vocab_size {vocab_size}")
        start = torch.as_tensor(self.vocab.encode(self.prompt), device=device)[None]
        texts = []
        for s in range(self.samples):
            generator = torch.Generator(device=device).manual_seed(self.seed + s)
            with torch.no_grad(), (precision.autocast() if precision
                                        else contextlib.nullcontext()):
                ids = generate(start, self.max_new_tokens, temperature=self.temperature,
                               top_k=self.top_k, generator=generator)
            texts.append(self.vocab.decode(ids[0].tolist()))
        return texts

    def __call__(self, *, net, precision, device) -> int:
        texts = self.texts(net, device, precision)
        if is_main():
            atomic_write_text(self.output, "".join(
                f"--- sample {s} (seed {self.seed + s})\n{text}\n"
                for s, text in enumerate(texts)))
            log.info("wrote %d generated text(s) of %d characters to %s", len(texts),
                     self.max_new_tokens, self.output)
            log.info("%s", texts[0])
        return len(texts)

