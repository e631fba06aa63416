"""--task lm: a causal language model, as nanoGPT's loop trains it, with the trainer's guarantees.

  data      byte tokens in windows of the model's context (train/tasks/text.py): --dataset copy (the default: copy
            documents generated from the seed, whose exact floor is known) or --dataset text (DATA_DIR/{train,val}/
            *.txt; --tokenizer: a Hugging Face tokenizer.json's tokens instead of bytes, the file's sha256 in task.json
            and a resume refused if it changed); --train-samples and --val-samples count copy's windows
  model     --model gpt-tiny (the default) or gpt-small (train/components/gpt.py), or package.module:factory, a
            function of the vocabulary's size returning a module of token ids N x T to logits N x T x V (its context:
            --task-settings context=N)
  loss      cross-entropy summed over the labelled tokens (a window's padding is IGNORE), counted in labelled tokens:
            the trainer divides by the labelled tokens of the whole step, on every rank
  metric    the validation loss in nats per token picks best.pt; the state: the loss sum, the labelled tokens and the
            windows, summed across ranks; the perplexity exp(loss) and the bits per byte (a token is a byte) of the
            whole set, and for copy its floor and the excess over it
  report    make evaluate: the scores, and continuations of the first validation windows' openings (greedy, and at a
            temperature of 0.8 from a seed), beside their prompts
  export    token ids N x T in, logits N x T x V out, the batch and the sequence's length both dynamic
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from train.base.errors import ConfigError
from train.components.gpt import SIZES, Gpt
from train.components.models import user_factory
from train.config.catalog import source
from train.config.settings import LM_MODEL, Model
from train.files.rundir import read_description
from train.tasks.task import Task
from train.tasks.text import (COPY_SHORTEST, IGNORE, Bytes, CopyWindows, TextWindows, TokenizerFile, text_files,
                              vocabulary)

TAKES = "the vocabulary's size and returns a module of token ids N x T to logits N x T x V"
PROMPT, SHOWN = 16, 3  # make evaluate's continuations: the first 16 tokens of the first 3 validation windows


@dataclass
class Settings:
    context: int = 0  # the tokens of a window; 0: the model's (64 for a model of your own)


class LanguageModel(Task):
    name = "lm"
    metric = "loss"
    higher_is_better = False
    variable_count = True  # the labelled tokens of a batch
    Settings = Settings

    def sizes(self, where: str) -> list[tuple[str, object]]:
        """A window's tokens: the context."""
        return [("--task-settings context", self.context)]

    @property
    def context(self) -> int:
        given = self.settings.context if self.settings is not None else 0
        size = SIZES.get(self.cfg.model.model)
        if given < 0:
            raise ConfigError(f"--task-settings context={given}: give a positive number of tokens, or 0 for the "
                              f"model's")
        if given and size is not None and given > size.context:
            raise ConfigError(f"--task-settings context={given} is longer than --model {self.cfg.model.model}'s "
                              f"context of {size.context}: give at most {size.context}")
        return given or (size.context if size is not None else 64)

    @property
    def vocab(self) -> Bytes | TokenizerFile:
        """The tokens: the bytes', or --tokenizer's (loaded once; a file that does not load is one line)."""
        if getattr(self, "_vocab", None) is None:
            self._vocab = vocabulary(self.cfg.data.tokenizer)
        return self._vocab

    # ---------------------------------------------------------------- data and model

    def check(self, run_dir=None, train: bool = True) -> None:
        cfg = self.cfg
        if self.name not in source(cfg.data.dataset).tasks:
            raise ConfigError(f"--dataset {cfg.data.dataset} holds no text: --task lm trains on --dataset copy "
                              f"(generated, the default) or text (DATA_DIR/train/*.txt and DATA_DIR/val/*.txt)")
        if cfg.model.model not in SIZES and ":" not in cfg.model.model:
            raise ConfigError(f"--model {cfg.model.model} is not a language model: pass one of {', '.join(SIZES)} "
                              f"(default {LM_MODEL}), or package.module:factory")
        if ":" in cfg.model.model:
            user_factory(cfg.model.model, takes=TAKES)  # it imports, and names a function
        if cfg.data.dataset == "copy" and self.context < COPY_SHORTEST:
            raise ConfigError(f"--task-settings context={self.context}: a window of --dataset copy holds at least one "
                              f"whole document ({COPY_SHORTEST} tokens at most): give a context of {COPY_SHORTEST} or "
                              f"more")
        if cfg.data.dataset == "text":
            for split in ("train", "val") if train else ("val",):
                text_files(Path(cfg.data.data_dir), split)
        self.same_tokenizer(run_dir)

    def same_tokenizer(self, run_dir) -> None:
        """A run trained with a tokenizer.json reads that file again, resumed or evaluated (its sha256 in task.json)."""
        vocab = self.vocab  # --tokenizer's file loads, or one line
        if run_dir is None or vocab.name != "tokenizer":
            return
        recorded = (read_description(Path(run_dir)) or {}).get("tokenizer_sha256")
        if recorded not in (None, vocab.sha256):
            raise ConfigError(f"--tokenizer {self.cfg.data.tokenizer} is not the file {run_dir} was trained with "
                              f"(sha256 {vocab.sha256[:12]}..., the run's {recorded[:12]}...): give that file "
                              f"back, or start a new --run-dir")

    def datasets(self, run_dir=None, train: bool = True) -> tuple:
        cfg, context = self.cfg, self.context
        if cfg.data.dataset == "copy":
            train_set = CopyWindows(cfg.data.train_samples, context, cfg.run.seed, 1) if train else None
            val_set = CopyWindows(cfg.data.val_samples, context, cfg.run.seed, 2)
            total, count = val_set.floor()
            floor = {"floor": total / count}
        else:
            root = Path(cfg.data.data_dir)
            self.same_tokenizer(run_dir)
            train_set = TextWindows(root, "train", context, self.vocab) if train else None
            val_set, floor = TextWindows(root, "val", context, self.vocab), {}
        self.description = {**self.vocab.describe(), "context": context, "dataset": cfg.data.dataset, **floor}
        return train_set, val_set

    def network(self, spec: Model) -> nn.Module:
        if ":" in spec.model:  # a function of the vocabulary's size (its one argument)
            return user_factory(spec.model, takes=TAKES)(self.vocab.size)
        return Gpt(SIZES[spec.model], self.vocab.size)

    def blocks(self, model: nn.Module) -> list[str]:
        """The decoder's transformer blocks (a model of one's own with a ModuleList `blocks` too)."""
        layers = getattr(model, "blocks", None)
        return [f"blocks.{i}" for i in range(len(layers))] if isinstance(layers, nn.ModuleList) else []

    # ---------------------------------------------------------------- a step

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if output.dim() != 3 or output.shape[:2] != target.shape or output.shape[2] != self.vocab.size:
            raise ConfigError(f"--model {self.cfg.model.model} gives {list(output.shape)} for token ids "
                              f"{list(target.shape)}, and --task lm takes N x T x {self.vocab.size} logits: make the "
                              f"network return them")
        total = F.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="sum")
        return total, self.count(target)

    def count(self, target: torch.Tensor) -> torch.Tensor:
        return (target != IGNORE).sum()

    def example(self, batch_size: int, device: torch.device) -> tuple:
        zeros = torch.zeros(batch_size, self.context, dtype=torch.long, device=device)
        return zeros, zeros.clone()

    def throughput(self, samples_per_s: float) -> tuple[float, str]:
        return samples_per_s * self.context, "tokens"

    # ---------------------------------------------------------------- evaluation

    def metric_state(self, device: torch.device, detail: bool = False) -> torch.Tensor:
        """The loss sum, the labelled tokens, the windows, the labelled bytes (byte tokens: the tokens but END)."""
        return torch.zeros(4, dtype=torch.float64, device=device)

    def update(self, state: torch.Tensor, output: torch.Tensor, target: torch.Tensor) -> None:
        total, count = self.loss(output if output.dtype == torch.float64 else output.float(), target)
        windows = torch.tensor(float(len(target)), device=state.device, dtype=torch.float64)
        text = count - (target == self.vocab.end).sum() if self.vocab.name == "bytes" else torch.zeros_like(count)
        state += torch.stack([total.double(), count.double(), windows, text.double()])

    def scores(self, state: torch.Tensor, detail: bool = False) -> dict:
        total, tokens, windows, text = state.tolist()
        if not tokens:
            raise ConfigError("the validation windows label no token: an evaluation of nothing has no figures")
        loss = total / tokens
        scores = {"loss": loss, "perplexity": math.exp(min(loss, 700)), "tokens": int(tokens), "samples": int(windows)}
        if self.vocab.name == "bytes":  # the ENDs' cost spread on the bytes
            scores["bits_per_byte"] = total / math.log(2) / text if text else math.nan
        if "floor" in self.description:
            scores.update(floor=self.description["floor"], excess=loss - self.description["floor"])
        return scores

    def summary(self, scores: dict) -> str:
        floor = f", {scores['excess']:.4f} over the floor" if "excess" in scores else ""
        return (f"loss {scores['loss']:.4f} nats/token, perplexity {scores['perplexity']:.3f}{floor}, "
                f"{scores['tokens']} tokens in")

    def pictures(self, model: nn.Module, val_set, device: torch.device) -> list:
        """make evaluate's continuations: the first validation windows' openings, continued greedily and at a
        temperature of 0.8 (a generator seeded from the run's seed), to the context's end."""
        model.eval()
        shown, g = [], torch.Generator(device="cpu").manual_seed(self.cfg.run.seed)
        with torch.inference_mode():
            for i in range(min(SHOWN, len(val_set))):
                prompt = val_set[i][0][:PROMPT]
                made = {kind: self.vocab.decode(
                            continuation(model, prompt, self.context, device, temperature, g).tolist())
                        for kind, temperature in (("greedy", 0), ("sampled", 0.8))}
                shown.append({"prompt": self.vocab.decode(prompt.tolist()), **made})
        return shown

    def report(self, record: dict, result: dict, pictures: list | None = None) -> tuple:
        from train.report import figure as figures  # noqa: PLC0415 - matplotlib: the evaluation command's alone

        record["continuations"] = pictures or []
        lines = [self.summary(result)] + [f"{c['prompt']!r} -> greedy {c['greedy']!r}, sampled {c['sampled']!r}"
                                          for c in record["continuations"]]
        figure = figures.plt.figure(figsize=(9, 1 + 0.5 * len(lines)))
        figure.text(0.01, 0.5, "\n".join(lines), family="monospace", fontsize=8, va="center")
        return figure, lines

    # ---------------------------------------------------------------- records

    def facts(self) -> dict:
        tokens = {k: v for k, v in self.vocab.describe().items() if k != "vocabulary"}
        return {**super().facts(), "loss": f"CrossEntropyLoss(ignore_index={IGNORE}), summed over the labelled "
                                           f"tokens, divided by those of the step", "context": self.context, **tokens}

    def source(self, train_set, val_set) -> dict:
        if self.cfg.data.dataset == "copy":
            return {"kind": "copy", "order": "window i drawn from its own seed", "classes_from": "none: byte tokens"}
        return {"kind": "text", "train": f"{self.cfg.data.data_dir}/train/**/*.txt",
                "val": f"{self.cfg.data.data_dir}/val/**/*.txt",
                "order": "the files sorted by path, joined with END, cut into windows", "classes_from": "none"}

    def export_io(self) -> tuple:
        return (torch.zeros(2, min(16, self.context), dtype=torch.long), {"input": "ids", "output": "logits"},
                {"input_shape": ["N", "T"],
                 "output": f"N x T x {self.vocab.size} logits: the next token's, at each position",
                 "vocabulary": self.description.get("vocabulary"), "end_token": self.vocab.end,
                 "context": self.context})

    def dynamic_dims(self) -> dict:
        return {0: ("batch", None), 1: ("sequence", self.context)}


def continuation(model: nn.Module, prompt: torch.Tensor, context: int, device: torch.device, temperature: float,
                 g: torch.Generator) -> torch.Tensor:
    """The prompt's tokens continued to `context`: the most likely next token each time, or drawn at a temperature."""
    ids = prompt.to(device)[None]
    while ids.shape[1] < context:
        logits = model(ids)[0, -1].float().cpu()
        if temperature:
            token = torch.multinomial(torch.softmax(logits / temperature, dim=0), 1, generator=g)
        else:
            token = logits.argmax()[None]
        ids = torch.cat([ids, token.to(device)[None]], dim=1)
    return ids[0, len(prompt):].cpu()
