"""--task lm in this process: the copy documents and their exact floor (a model that gives the generator's true
probabilities scores it), the windows of a text folder (every token predicted once), the data's checks, and the
evaluation's state summed over ranks' shares as at any world size."""

import hashlib
import math

import pytest
import torch
from torch import nn

from tests.helpers import byte_level_tokenizer
from train.base.errors import ConfigError
from train.cli import parse_config
from train.loading import build_train_loader, build_val_loader, default_num_workers, sampling
from train.loading.loaders import loader_workers, read_workers
from train.run.validate import validate
from train.tasks.factory import build_task
from train.tasks.text import COPY, END, IGNORE, LETTERS, VOCAB, CopyChain, CopyWindows, TextWindows, vocabulary

CPU = torch.device("cpu")


class TrueModel(nn.Module):
    """The copy documents' true next-token log-probabilities, read off each window by following its documents (not the
    generator's record of what it drew): a letter after i letters (the chain's move, unless the document ends there:
    "|", its length uniform up to what the room left from its start takes), the copy (certain), END after it
    (certain), a new document's first letter after END."""

    def __init__(self, chain: CopyChain):
        super().__init__()
        self.chain = chain

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.full((*ids.shape, VOCAB), -math.inf, dtype=torch.float64)
        for n, window in enumerate(ids.tolist()):
            phase, letters, copied, started = "first", [LETTERS.index(window[0])], 0, 0
            for j, token in enumerate(window):
                if j:
                    if phase == "first":
                        phase, copied = ("copy", 0) if token == COPY else ("first", copied)
                        if phase == "first":
                            letters.append(LETTERS.index(token))
                    elif phase == "copy":
                        phase, copied = ("end", copied) if token == END else ("copy", copied + 1)
                    elif token != END:
                        phase, letters, started = "first", [LETTERS.index(token)], j
                if phase == "first":  # the window holds len(window) + 1 tokens
                    stop = self.chain.stop(len(letters), self.chain.longest(len(window) + 1 - started))
                    out[n, j, COPY] = math.log(stop) if stop else -math.inf
                    for k, move in enumerate(self.chain.moves[letters[-1]]):
                        out[n, j, LETTERS[k]] = math.log((1 - stop) * move) if stop < 1 else -math.inf
                elif phase == "copy":
                    out[n, j, LETTERS[letters[copied]] if copied < len(letters) else END] = 0.0
                else:
                    for k, start in enumerate(self.chain.start):
                        out[n, j, LETTERS[k]] = math.log(start)
        return out


def _lm(*flags):
    task = build_task(parse_config(["--task", "lm", "--train-samples", "64", "--val-samples", "53", *flags]))
    return task, *task.datasets()


def test_a_model_of_the_true_probabilities_scores_the_floor_and_any_split_of_the_set_sums_to_it():
    """No training: the true distribution's loss is the floor the task reports (float64, to its rounding), whatever
    the workers the evaluation's set is shared by: 1, 2 and 3 ranks' shares (53 windows: 18, 18, 17) summed."""
    task, _, val_set = _lm()
    model = TrueModel(val_set.chain)
    cfg = task.cfg
    states = []
    for world in (1, 2, 3):
        shares = [build_val_loader(val_set, cfg.data, 4, rank, world, False, CPU) for rank in range(world)]
        parts = [validate(model, loader, task, CPU, None, detail=False) for loader in shares]
        states.append([sum(p[k] for p in parts) for k in ("tokens", "samples")])
    assert states[0] == states[1] == states[2] and states[0][1] == 53
    scores = validate(model, build_val_loader(val_set, cfg.data, 4, 0, 1, False, CPU), task, CPU, None)
    assert scores["floor"] == task.description["floor"] and abs(scores["excess"]) <= 1e-12 * scores["loss"]
    assert scores["perplexity"] == pytest.approx(math.exp(scores["floor"]), rel=1e-12)
    untrained = build_task(cfg).network(cfg.model).double()
    assert validate(untrained, build_val_loader(val_set, cfg.data, 4, 0, 1, False, CPU), task, CPU,
                    None)["excess"] > 3  # the control: a model that knows nothing is far above it


def test_copy_windows_are_drawn_from_their_seed_and_hold_whole_documents():
    a, b = CopyWindows(20, 64, seed=3, split=1), CopyWindows(99, 64, seed=3, split=1)
    assert all(torch.equal(a[i][0], b[i][0]) and torch.equal(a[i][1], b[i][1]) for i in range(20))
    assert not torch.equal(a[0][0], CopyWindows(20, 64, seed=3, split=2)[0][0])
    ids, targets = a[5]
    assert ids.shape == targets.shape == (64,) and torch.equal(ids[1:][targets[:-1] != IGNORE],
                                                               targets[:-1][targets[:-1] != IGNORE])
    documents, current = [], []
    for token in [*ids.tolist(), int(targets[-1]) if targets[-1] != IGNORE else END]:
        if token == END:
            documents, current = documents + ([bytes(current).decode()] if current else []), []
        else:
            current.append(token)
    assert documents and all(d.count("|") == 1 and d.split("|")[0] == d.split("|")[1] for d in documents), documents


def test_a_text_folder_is_cut_into_windows_that_predict_every_token_once(tmp_path):
    for split, texts in (("train", [b"hello world\n", b"\xff\xfe not utf-8"]), ("val", [b"a" * 70])):
        (tmp_path / split / "sub").mkdir(parents=True)
        for i, text in enumerate(texts):
            (tmp_path / split / ("sub" if i else "") / f"{i}.txt").write_bytes(text)
    windows = TextWindows(tmp_path, "train", 8)
    stream = list(b"hello world\n") + [END] + list(b"\xff\xfe not utf-8") + [END]
    predicted = [t for i in range(len(windows)) for t in windows[i][1].tolist() if t != IGNORE]
    assert predicted == stream[1:] and len(windows) == math.ceil((len(stream) - 1) / 8)
    (tmp_path / "train" / "empty.txt").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"1 empty \.txt file\(s\) \(train/empty\.txt\): a document holds at least"):
        TextWindows(tmp_path, "train", 8)
    with pytest.raises(ConfigError, match=r"holds 71 tokens .* fewer than one window of 129"):
        TextWindows(tmp_path, "val", 128)
    with pytest.raises(ConfigError, match="test is missing: --dataset text reads DATA_DIR/train"):
        TextWindows(tmp_path, "test", 8)


def test_text_windows_are_cut_in_the_training_process_unless_num_workers_asks_for_loader_workers(tmp_path):
    """Slices of tokens held in memory: a loader worker would only copy them (make bench's language-model row), so none
    by default; --num-workers N still gives N, and files of another source still get the cores' share."""
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.txt").write_bytes(b"x" * 100)
    windows = TextWindows(tmp_path, "train", 8)
    for flags, workers in (([], 0), (["--num-workers", "2"], 2)):
        cfg = parse_config(["--task", "lm", "--dataset", "text", "--data-dir", str(tmp_path), *flags])
        loader, _ = build_train_loader(windows, sampling(cfg), cfg.data, 0, 1, pin_memory=False)
        assert loader.num_workers == workers == read_workers(cfg.data) == default_num_workers(cfg.data)
        assert build_val_loader(windows, cfg.data, 4, 0, 1, pin_memory=False).num_workers == workers
    files = parse_config(["--dataset", "imagefolder"]).data
    assert read_workers(files) == default_num_workers(files) == loader_workers() >= 1
    own = parse_config(["--task", "tests.tasks:masked", "--num-workers", "3"]).data  # a task's own set: as asked
    assert read_workers(own) == default_num_workers(own) == 3


def test_a_tokenizer_json_turns_each_utf8_file_into_its_tokens_and_a_file_that_cannot_be_is_one_line(tmp_path):
    texts = {"train": ["the cat sat on the mat\n", "naïve café über alles " * 3], "val": ["the dog ran " * 8]}
    for split, docs in texts.items():
        (tmp_path / split).mkdir()
        for i, doc in enumerate(docs):
            (tmp_path / split / f"{i}.txt").write_text(doc, encoding="utf-8")
    path = byte_level_tokenizer([d for docs in texts.values() for d in docs], tmp_path / "tokenizer.json")
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(path))
    vocab = vocabulary(str(path))
    assert (vocab.end, vocab.size) == (reference.get_vocab_size(), reference.get_vocab_size() + 1)
    windows = TextWindows(tmp_path, "train", 8, vocab)
    stream = [t for doc in texts["train"] for t in [*reference.encode(doc, add_special_tokens=False).ids, vocab.end]]
    predicted = [t for i in range(len(windows)) for t in windows[i][1].tolist() if t != IGNORE]
    assert predicted == stream[1:] and len(windows) == math.ceil((len(stream) - 1) / 8)
    assert vocab.decode(stream) == "".join(doc + "\n" for doc in texts["train"])  # END shown as a newline
    described = vocab.describe()
    assert described["tokenizer_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    (tmp_path / "train" / "2.txt").write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"2\.txt is not UTF-8 \(byte 3\): --tokenizer reads text: save it as UTF-8, "
                                          r"or drop --tokenizer \(byte tokens read any bytes\)"):
        TextWindows(tmp_path, "train", 8, vocab)
    (tmp_path / "bad.json").write_text('{"model": 1}')
    with pytest.raises(ConfigError, match=r"bad\.json does not load as a Hugging Face tokenizer\.json \(.+\): give the "
                                          r"file tokenizers' Tokenizer\.save wrote, or drop it for byte tokens$"):
        vocabulary(str(tmp_path / "bad.json"))
    with pytest.raises(ConfigError, match=r"none\.json is missing: give the path of a tokenizer\.json"):
        vocabulary(str(tmp_path / "none.json"))
    with pytest.raises(ConfigError, match=r"--tokenizer .* has no effect with --task lm --dataset copy \(a tokenizer"):
        parse_config(["--task", "lm", "--tokenizer", str(path)])
    with pytest.raises(ConfigError, match=r"--tokenizer .* has no effect with --task classification --dataset text"):
        parse_config(["--dataset", "text", "--tokenizer", str(path)])


@pytest.mark.parametrize("flags, line", [
    (["--dataset", "shapes"], "--dataset shapes holds no text: --task lm trains on --dataset copy"),
    (["--model", "resnet18"], "--model resnet18 is not a language model: pass one of gpt-tiny, gpt-small"),
    (["--task-settings", "context=128"], "--task-settings context=128 is longer than --model gpt-tiny's context of 64"),
])
def test_the_language_models_settings_that_cannot_be_are_one_line(flags, line):
    task = build_task(parse_config(["--task", "lm", *flags]))
    with pytest.raises(ConfigError, match=line):
        task.check()


def test_the_image_pipelines_settings_are_refused_with_the_language_model():
    with pytest.raises(ConfigError, match=r"--image-size 32 has no effect with --task lm \(byte tokens, no images"):
        parse_config(["--task", "lm", "--image-size", "32"])
    cfg = parse_config(["--task", "lm"])
    assert (cfg.model.model, cfg.data.dataset, cfg.optimisation.batch_size) == ("gpt-tiny", "copy", 32)
    assert parse_config(["--task", "lm", "--preset", "debug"]).optimisation.batch_size == 16  # a preset's own wins
