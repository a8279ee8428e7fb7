"""A learned reward: a sequence-classification model scoring prompt + completion.

    RewardModel(path="rm/")(completions, text=[prompt, ...])  -> [logit of `label`, ...]

`path` is a local Hugging Face directory (AutoModelForSequenceClassification and its tokenizer),
loaded on the first call in the process that scores (so a reward role can be sent to a worker
before it loads anything). The rollouts' `text` field (the prompt as the policy saw it) is
prepended to each completion; the score is the logit of class `label` (0 for the usual one-output
reward model), in eval mode, without gradients, on `device` ("auto": the GPU when there is one).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlgraph.errors import ConfigError


class RewardModel:
    def __init__(self, path: str, device: str = "auto", batch_size: int = 16, max_length: int = 1024, label: int = 0,
                 dtype: str = "float32"):
        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"reward_model: path {path!r} holds no config.json",
                              fix="point it at a directory written by model.save_pretrained(...) and tokenizer.save_pretrained(...)")
        for name, value in (("batch_size", batch_size), ("max_length", max_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"reward_model: {name}={value!r} must be a whole number >= 1")
        if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ConfigError(f"reward_model: dtype {dtype!r} is not a torch dtype", fix="use float32, bfloat16 or float16")
        if device not in ("auto", "cpu", "cuda") and not str(device).startswith("cuda:"):
            raise ConfigError(f"reward_model: device {device!r} is not auto, cpu, cuda or cuda:N")
        self.path, self.device, self.batch_size, self.max_length = str(path), device, batch_size, max_length
        self.label, self.dtype = label, dtype
        self._model: Any = None
        self._tokenizer: Any = None
        self._on: str | None = None  # the device it loaded on

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_model": None, "_tokenizer": None, "_on": None}  # workers load their own copy

    def load(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(self.path)
        if self._tokenizer.pad_token is None:
            self._tokenizer.pad_token = self._tokenizer.eos_token
        self._tokenizer.padding_side = "right"
        model = AutoModelForSequenceClassification.from_pretrained(self.path, dtype=getattr(torch, self.dtype))
        if model.config.pad_token_id is None:
            model.config.pad_token_id = self._tokenizer.pad_token_id  # the score is read at the last non-pad token
        labels = model.config.num_labels
        if not 0 <= self.label < labels:
            raise ConfigError(f"reward_model {self.path}: label={self.label} but the model has {labels} output(s)")
        # "auto" is resolved where it scores: a worker may have a GPU the controller lacks.
        self._on = ("cuda" if torch.cuda.is_available() else "cpu") if self.device == "auto" else self.device
        self._model = model.to(self._on).eval()

    @torch.no_grad()
    def __call__(self, completions: Sequence[str], text: Sequence[str] | None = None, **_: Any) -> list[float]:
        if self._model is None:
            self.load()
        prompts = list(text) if text is not None else [""] * len(completions)
        scores: list[float] = []
        for start in range(0, len(completions), self.batch_size):
            pairs = [p + c for p, c in zip(prompts[start:start + self.batch_size], completions[start:start + self.batch_size])]
            batch = self._tokenizer(pairs, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length)
            logits = self._model(**batch.to(self._on)).logits[:, self.label]
            scores.extend(logits.float().cpu().tolist())
        return scores

    def __repr__(self) -> str:
        return f"RewardModel({self.path!r}, device={self.device!r})"
