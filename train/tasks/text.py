"""--task lm's data: byte tokens (0 .. 255, and END = 256 between documents), as windows of a context's tokens, each
item (ids, targets), the targets the ids shifted by one and IGNORE (-100) where nothing is to be predicted.

  --dataset copy   generated from the seed, no download: short documents of a seeded Markov chain over 16 letters,
                   each followed by "|" and its own copy, then END. The generator knows the probability of every token
                   it draws, so the validation set's floor (the mean loss the true distribution scores, below which no
                   model gets) is exact. Each window holds whole documents, padded at its end; window i is drawn from
                   its own seed when a loader asks for it, so any world size reads the same windows.
  --dataset text   DATA_DIR/train/**/*.txt and DATA_DIR/val/**/*.txt (sorted by path): each file a document of any
                   bytes (byte tokens read every file, UTF-8 or not), joined with END and cut into windows one context
                   apart, every token predicted once; held in memory. With --tokenizer, a Hugging Face tokenizer.json
                   (the tokenizers package) turns each file, which must then be UTF-8, into its tokens instead, END
                   being the id after its vocabulary's last.
"""

from __future__ import annotations

import hashlib
import math
import random
from pathlib import Path

import torch
from torch.utils.data import Dataset

from train.base.errors import ConfigError, first_few

END = 256  # between documents
VOCAB = 257  # the bytes and END
IGNORE = -100  # a target that counts for nothing: a window's padding
LETTERS = [ord(c) for c in "abcdefghijklmnop"]  # the copy documents' alphabet
COPY = ord("|")  # between a copy document and its copy
SHORTEST, LONGEST = 3, 10  # a copy document's letters, uniform (up to what the window's room left takes)
COPY_SHORTEST = 2 * SHORTEST + 1  # the shortest context whose windows hold a copy document


class CopyChain:
    """The copy documents' generator: a Markov chain over LETTERS (its first letter from `start`, each next from
    `moves` of the last), drawn from the seed."""

    def __init__(self, seed: int):
        rng = random.Random(seed * 7919 + 17)
        weights = [rng.random() ** 2 + 0.05 for _ in LETTERS]
        self.start = [w / sum(weights) for w in weights]
        self.moves = []
        for _ in LETTERS:
            row = [rng.random() ** 4 + 0.01 for _ in LETTERS]
            self.moves.append([w / sum(row) for w in row])

    @staticmethod
    def longest(room: int) -> int:
        """The letters of the longest document `room` tokens take (its letters, "|", their copy and END), at most
        LONGEST: a document starting where the window leaves that room (which a model sees) is at most that long."""
        return min(LONGEST, (room - 2) // 2)

    @staticmethod
    def stop(emitted: int, longest: int = LONGEST) -> float:
        """The chance that a document ends after `emitted` letters, its length uniform on SHORTEST .. longest."""
        return 1 / (longest - emitted + 1) if SHORTEST <= emitted <= longest else 0.0

    def window(self, tokens: int, rng: random.Random) -> tuple[list[int], list[float]]:
        """`tokens` tokens of whole documents, each as long as the room left lets it be, END-padded once no document
        fits; each token's probability given those before it (the first token's, and the padding's, None)."""
        out, chances = [], []
        while (longest := self.longest(tokens - len(out))) >= SHORTEST:
            length = rng.randint(SHORTEST, longest)
            letters = [rng.choices(range(len(LETTERS)), self.start)[0]]
            p = [self.start[letters[0]]]
            while len(letters) < length:
                nxt = rng.choices(range(len(LETTERS)), self.moves[letters[-1]])[0]
                p.append((1 - self.stop(len(letters), longest)) * self.moves[letters[-1]][nxt])
                letters.append(nxt)
            p.append(self.stop(length, longest))
            out += [LETTERS[i] for i in letters] + [COPY] + [LETTERS[i] for i in letters] + [END]
            chances += p + [1.0] * (length + 1)
        chances[0] = None
        padding = tokens - len(out)
        return out + [END] * padding, chances + [None] * padding


def as_item(tokens: list[int], chances: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, targets) of a window of context + 1 tokens: the targets are the next tokens, IGNORE where none is known."""
    ids = torch.tensor(tokens[:-1], dtype=torch.long)
    targets = torch.tensor([t if c is not None else IGNORE for t, c in zip(tokens[1:], chances[1:], strict=True)],
                           dtype=torch.long)
    return ids, targets


class CopyWindows(Dataset):
    """`count` windows of `context` tokens of copy documents; window i drawn from its own seed (seed, split, i)."""

    def __init__(self, count: int, context: int, seed: int, split: int):
        self.count, self.context, self.seed, self.split = count, context, seed, split
        self.chain = CopyChain(seed)

    def __len__(self) -> int:
        return self.count

    def drawn(self, index: int) -> tuple[list[int], list]:
        return self.chain.window(self.context + 1, random.Random((self.seed * 1_000_003 + self.split) * 10_000_019
                                                                 + index))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return as_item(*self.drawn(index))

    def floor(self) -> tuple[float, int]:
        """(the nats every labelled token of the set costs the true distribution, summed; those tokens)."""
        total, count = 0.0, 0
        for i in range(self.count):
            for chance in self.drawn(i)[1][1:]:
                if chance is not None:
                    total, count = total - math.log(chance), count + 1
        return total, count


def text_files(root: Path, split: str) -> list[Path]:
    """A split's .txt files (in its subfolders too), sorted by path; each a document of at least one byte."""
    folder = root / split
    if not folder.is_dir():
        raise ConfigError(f"{folder} is missing: --dataset text reads DATA_DIR/train/*.txt and DATA_DIR/val/*.txt")
    files = sorted(p for p in folder.rglob("*.txt") if p.is_file())
    if not files:
        raise ConfigError(f"{folder} holds no .txt file: put the split's documents there, one per file")
    empty = [str(p.relative_to(root)) for p in files if p.stat().st_size == 0]
    if empty:
        raise ConfigError(f"{root}: {len(empty)} empty .txt file(s) ({first_few(empty)}): a document holds at least "
                          f"one byte: remove them")
    return files


class Bytes:
    """Byte tokens: 0 .. 255, END = 256 between documents; any bytes, UTF-8 or not."""

    size, end, name = VOCAB, END, "bytes"

    def describe(self) -> dict:
        return {"vocabulary": "bytes, and END (256) between documents", "vocab_size": VOCAB, "end_token": END}

    def encode(self, data: bytes, path: Path) -> torch.Tensor:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16)

    def decode(self, ids: list[int]) -> str:
        """As text (END shown as a newline; bytes that are no UTF-8 replaced)."""
        return bytes(10 if t == END else t for t in ids).decode("utf-8", errors="replace")


class TokenizerFile:
    """A Hugging Face tokenizer.json (--tokenizer): its ids, END the one after its last; the file's sha256 recorded."""

    name = "tokenizer"

    def __init__(self, path: Path):
        from tokenizers import Tokenizer  # noqa: PLC0415 - --tokenizer's alone

        if not path.is_file():
            raise ConfigError(f"--tokenizer {path} is missing: give the path of a tokenizer.json (what tokenizers' "
                              f"Tokenizer.save writes), or drop it for byte tokens")
        data = path.read_bytes()
        try:
            self.tokenizer = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # noqa: BLE001 - the library's parse errors are of several kinds: each is this one line
            cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"--tokenizer {path} does not load as a Hugging Face tokenizer.json ({cause}): give the "
                              f"file tokenizers' Tokenizer.save wrote, or drop it for byte tokens") from None
        self.path, self.sha256 = path, hashlib.sha256(data).hexdigest()
        self.end = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.size = self.end + 1

    def describe(self) -> dict:
        return {"vocabulary": f"{self.path}'s tokens, and END ({self.end}) between documents", "vocab_size": self.size,
                "end_token": self.end, "tokenizer": str(self.path), "tokenizer_sha256": self.sha256}

    def encode(self, data: bytes, path: Path) -> torch.Tensor:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path} is not UTF-8 (byte {e.start}): --tokenizer reads text: save it as UTF-8, or "
                              f"drop --tokenizer (byte tokens read any bytes)") from None
        return torch.tensor(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=torch.int32)

    def decode(self, ids: list[int]) -> str:
        """As text (END shown as a newline)."""
        pieces, run = [], []
        for t in ids:
            if t == self.end:
                pieces += [self.tokenizer.decode(run), "\n"]
                run = []
            else:
                run.append(t)
        return "".join([*pieces, self.tokenizer.decode(run)])


def vocabulary(tokenizer: str) -> Bytes | TokenizerFile:
    """--tokenizer's vocabulary, or the bytes'."""
    return TokenizerFile(Path(tokenizer)) if tokenizer else Bytes()


class TextWindows(Dataset):
    """A split's documents (tokens, END after each) as windows of `context` tokens one context apart, the last padded:
    every token but the first predicted once."""

    def __init__(self, root: Path, split: str, context: int, vocab: Bytes | TokenizerFile | None = None):
        vocab = vocab or Bytes()
        kind = torch.int16 if vocab.size <= 2**15 else torch.int32
        end = torch.tensor([vocab.end], dtype=kind)
        pieces = [part for path in text_files(root, split)
                  for part in (vocab.encode(path.read_bytes(), path).to(kind), end)]
        self.tokens, self.context, self.end = torch.cat(pieces), context, vocab.end  # two bytes a token where they fit
        if len(self.tokens) < context + 1:
            what = "bytes" if isinstance(vocab, Bytes) else "tokens of --tokenizer"
            raise ConfigError(f"{root / split} holds {len(self.tokens)} tokens ({what} and an END after each file), "
                              f"fewer than one window of {context + 1} (the context and the token after it): give it "
                              f"more text, or a model of a shorter context")

    def __len__(self) -> int:
        return math.ceil((len(self.tokens) - 1) / self.context)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        piece = self.tokens[index * self.context:(index + 1) * self.context + 1].long()
        ids, targets = piece[:-1], piece[1:]
        padding = self.context - len(ids)
        ids = torch.cat([ids, torch.full((padding,), self.end, dtype=torch.long)])
        return ids, torch.cat([targets, torch.full((padding,), IGNORE, dtype=torch.long)])
