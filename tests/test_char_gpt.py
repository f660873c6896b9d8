"""The character GPT from the box: token files of the pydoc topics, config/experiments/
char_gpt.yaml trained a few steps through the CLI, and the text its runner generates."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from pydoc_data.topics import topics

from echelon3.config.errors import UserError
from echelon3.datasets.char_text import UNKNOWN, Vocab, main, prepare, pydoc_text
from echelon3.datasets.token_windows import TokenWindows
from echelon3.nets.gpt import GPT
from tests.helpers import echelon3, history, load

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "config" / "experiments" / "char_gpt.yaml"
STEPS, EVERY, VAL_SAMPLES = 15, 5, 32
WARMUP = ("scheduler.config.milestones=[5]",  # of STEPS, as the shipped 20 are of 400
          "scheduler.config.schedulers.0.config.total_iters=5",
          "scheduler.config.schedulers.1.config.T_max=total_steps - 5")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A network this small runs fastest on one thread; on a loaded machine two threads
    cost many times the work in waiting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("char_text")
    assert main([str(folder)]) == 0
    return folder


def test_the_token_files_hold_the_text_and_decode_back_to_it(prepared):
    text = pydoc_text()
    by_hand = sum(len(page) for page in topics.values()) + len(topics) - 1  # joined by "\n"
    train = np.fromfile(prepared / "train.bin", dtype=np.uint16)
    val = np.fromfile(prepared / "val.bin", dtype=np.uint16)
    assert len(train) + len(val) == len(text) == by_hand
    assert len(val) == int(by_hand * 0.1) and len(train) == by_hand - int(by_hand * 0.1)
    vocab = Vocab.load(prepared / "vocab.json")
    assert vocab.chars == sorted(set(text))
    assert vocab.decode(vocab.encode(text)) == text
    assert vocab.decode(train) + vocab.decode(val) == text
    assert len(vocab) <= yaml.safe_load(SHIPPED.read_text())["net"]["config"]["vocab_size"]
    assert vocab.decode([1, len(vocab)]) == vocab.chars[1] + UNKNOWN


def test_prepare_is_deterministic_and_splits_any_text(tmp_path):
    counts = prepare(tmp_path / "a", "abcabcabca", val_fraction=0.3)
    assert counts == {"characters": 10, "train": 7, "val": 3, "vocab": 3}
    assert np.fromfile(tmp_path / "a" / "val.bin", dtype=np.uint16).tolist() == [1, 2, 0]
    prepare(tmp_path / "b", "abcabcabca", val_fraction=0.3)
    for name in ("train.bin", "val.bin", "vocab.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    with pytest.raises(ValueError, match="characters not in the vocabulary: 'xy'"):
        Vocab.of("abc").encode("axby")


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory) -> Path:
    """char_gpt.yaml as shipped, cut to STEPS steps, trained in this process."""
    folder = tmp_path_factory.mktemp("char_gpt")
    shutil.copy(SHIPPED, folder / "char_gpt.yaml")
    out = folder / "out"
    assert echelon3("train", folder, f"trainer.config.max_steps={STEPS}",
                    f"trainer.config.val_check_interval={EVERY}", "trainer.config.log_every_n_steps=5",
                    f"data.train.config.path={prepared / 'train.bin'}",
                    f"data.val.config.path={prepared / 'val.bin'}",
                    f"data.val.config.samples={VAL_SAMPLES}", "mlops.config.tensorboard=false",
                    f"target.path={out}", *WARMUP, f"runner.config.vocab={prepared / 'vocab.json'}",
                    name="char_gpt") == 0
    return folder


@pytest.fixture(scope="module")
def net(trained) -> GPT:
    cfg = yaml.safe_load(SHIPPED.read_text())["net"]["config"]
    gpt = GPT(**cfg)
    gpt.load_state_dict(load(trained / "out" / "best.tar")["model_state_dict"])
    return gpt.eval()


def test_char_gpt_trains_on_its_own_loss_and_the_loss_goes_down(trained, prepared, net):
    out = trained / "out"
    val = history(out, "val")
    assert [r["step"] for r in val] == [EVERY, 2 * EVERY, STEPS]
    losses = [r["loss"] for r in val]
    assert losses[0] > losses[1] > losses[2] and losses[0] < np.log(128)
    train = [r["loss"] for r in history(out, "train")]
    assert train[-1] < train[0] - 0.3
    # The last validation's loss is the network's own cross entropy on the val windows.
    windows = TokenWindows(str(prepared / "val.bin"), block_size=64, samples=VAL_SAMPLES,
                           seed=1)
    x, y = (torch.stack(t) for t in zip(*windows))
    with torch.no_grad():
        _, own = net(x, y)
    assert own.item() == pytest.approx(losses[-1], rel=1e-5)


def _generator(prepared, **kw):
    settings = dict(path="unused", vocab=str(prepared / "vocab.json"), prompt="The ",
                    max_new_tokens=24, temperature=0.8, top_k=20, seed=0)
    from echelon3.tasks.generate import TextGenerator

    return TextGenerator(**{**settings, **kw})


def test_generation_is_seeded(prepared, net):
    text = _generator(prepared).texts(net, "cpu")[0]
    assert text.startswith("The ") and len(text) == 4 + 24
    assert _generator(prepared).texts(net, "cpu") == [text]
    two = _generator(prepared, seed=1, samples=2).texts(net, "cpu")
    assert two[0] != text and two[1] != two[0]
    assert _generator(prepared, seed=1).texts(net, "cpu") == two[:1]


def _next_logits(net, vocab, text):
    with torch.no_grad():
        return net(torch.as_tensor(vocab.encode(text))[None])[0]


def test_top_k_one_is_greedy_decoding_by_hand_and_top_k_bounds_every_draw(prepared, net):
    vocab = Vocab.load(prepared / "vocab.json")
    greedy = "The "
    for _ in range(24):
        greedy += vocab.chars[int(_next_logits(net, vocab, greedy)[-1].argmax())]
    assert _generator(prepared, top_k=1).texts(net, "cpu") == [greedy]
    assert _generator(prepared, temperature=0, top_k=None).texts(net, "cpu") == [greedy]
    drawn = _generator(prepared, top_k=3, temperature=2.0, seed=3).texts(net, "cpu")[0]
    logits = _next_logits(net, vocab, drawn)  # 28 characters: one window of block_size 64
    ids = vocab.encode(drawn)
    for t in range(3, len(ids) - 1):
        assert ids[t + 1] in torch.topk(logits[t], 3).indices.tolist(), t


def test_run_writes_the_generated_text(trained, prepared, net):
    assert echelon3("run", trained, f"target.path={trained / 'out'}",
                    f"runner.config.vocab={prepared / 'vocab.json'}",
                    "runner.config.max_new_tokens=24", name="char_gpt") == 0
    written = (trained / "out" / "generated.txt").read_text()
    assert written == f"--- sample 0 (seed 0)\n{_generator(prepared).texts(net, 'cpu')[0]}\n"


def test_bad_generator_settings_name_the_key(prepared, tmp_path):
    with pytest.raises(UserError, match=r"^runner.config.prompt: characters not in the "
                       r"vocabulary .*: '\\x07'"):
        _generator(prepared, prompt="The \a")
    with pytest.raises(UserError, match=r"^runner.config.vocab: no vocabulary file"):
        _generator(prepared, vocab=str(tmp_path / "none.json"))
    with pytest.raises(UserError, match=r"^runner.config.top_k: must be a whole number"):
        _generator(prepared, top_k=0)
    small = GPT(vocab_size=8, block_size=8, n_layer=1, n_head=1, n_embd=8)
    size = len(Vocab.load(prepared / "vocab.json"))
    with pytest.raises(UserError, match=rf"^runner.config.vocab: holds {size} characters, "
                       r"more than the network's vocab_size 8"):
        _generator(prepared).texts(small, "cpu")
