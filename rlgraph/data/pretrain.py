"""Continued pre-training data: raw text, tokenised, packed into fixed-length sequences, streamed.

    stream = TextStream.open("corpus/", text_field="text")     # documents, read one at a time
    packer = Packer(stream, tokenizer, seq_len=128, packs_per_step=8)
    batch = packer.next_batch()                                 # Rollouts: the SFT batch type

Sources: a `.txt` file (one document), a directory of `.txt` files (sorted by name, one document
each), a `.jsonl` file (one document per line, in `text_field`), or any other file `read_records`
reads (.json, .csv, .parquet, a `datasets.save_to_disk` directory), whose rows are read whole first.

Packing. Each document's tokens, then EOS, are laid end to end; a pack is the next `seq_len` of
them, so every pack holds exactly `seq_len` tokens and a document that does not fit continues in
the next pack. A pack is cut at document boundaries into *segments*.

Document boundaries: **no attention across documents**. Each segment is its own row of the batch,
with the tokenizer's BOS token (EOS when it has none) as its one-token prompt, so a token attends
only to earlier tokens of its own document and is predicted from them (the first from BOS). A
document cut by a pack boundary loses the context of its earlier part (as in any fixed-length
packing). Why rows, not one masked sequence: the trainer's forwards take one causal sequence per
row, and its packed path (`train.micro_batch_tokens`) already runs several rows as one sequence
without padding, restarting positions and confining attention to each row. So the packs run
unpadded and the mask is the one SFT uses: the loss is next-token over every token.

Streaming and resume: documents are read and tokenised as the packer needs them; its state is a
cursor (epoch, document, token offset inside it, steps taken), checkpointed with the run, so a
resumed run continues mid-epoch with exactly the packs the uninterrupted run would have seen.
Epochs walk the corpus in order (pre-shuffle the corpus; a shuffle needs random access that
streaming files do not give).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from rlgraph.batches import Prompts, Rollouts
from rlgraph.data.prompts import DataError, json_line, read_records


@attrs.frozen
class TextStream:
    """Documents of one source, in order; `documents(start)` reads them lazily from index `start`."""

    path: Path
    kind: str            # "txt", "dir", "jsonl" or "records"
    text_field: str = "text"

    @classmethod
    def open(cls, path: str | Path, *, text_field: str = "text") -> TextStream:
        source = Path(path)
        if not source.exists():
            raise DataError(f"data.train {str(path)!r}: no such file or directory",
                            fix=f"check the path (relative paths start at the working directory, {Path.cwd()})")
        if source.is_dir() and not (source / "dataset_info.json").exists() and not (source / "dataset_dict.json").exists():
            if not any(source.glob("*.txt")):
                raise DataError(f"data.train {source}: a directory without .txt files (nor a saved dataset)",
                                fix="put the corpus in .txt files (one document each) or point at a .jsonl file")
            return cls(source, "dir", text_field)
        kind = {".txt": "txt", ".jsonl": "jsonl"}.get(source.suffix.lower(), "records")
        stream = cls(source, kind, text_field)
        next(stream.documents(), None)  # the first document read now: a bad file fails before any model is built
        return stream

    def documents(self, start: int = 0) -> Iterator[str]:
        """The texts from document `start` on (skipped ones are not tokenised)."""
        if self.kind == "txt":
            texts: Iterator[str] = iter([_read(self.path)])
        elif self.kind == "dir":
            texts = (_read(file) for file in sorted(self.path.glob("*.txt")))
        elif self.kind == "jsonl":
            texts = self._jsonl()
        else:
            texts = (self._text_of(record, f"{self.path} row {index + 1}")
                     for index, record in enumerate(read_records(self.path)))
        for index, text in enumerate(texts):
            if index >= start:
                yield text

    def _jsonl(self) -> Iterator[str]:
        with self.path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    yield self._text_of(json_line(line, f"{self.path}:{number}"), f"{self.path}:{number}")

    def _text_of(self, record: Any, where: str) -> str:
        text = record.get(self.text_field) if isinstance(record, Mapping) else None
        if not isinstance(text, str):
            found = sorted(record) if isinstance(record, Mapping) else type(record).__name__
            raise DataError(f"{where}: no string field {self.text_field!r} (found {found})",
                            fix="set pretrain.text_field to the field that holds the document's text")
        return text


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason})", fix="save it as UTF-8") from None


class Packer:
    """Endless steps of `packs_per_step` packs of `seq_len` tokens from `stream`, as SFT batches.

    `state_dict()` is the cursor; `load_state_dict` refuses one taken with another packing.
    """

    def __init__(self, stream: TextStream, tokenizer: Any, *, seq_len: int, packs_per_step: int) -> None:
        for name, value in (("seq_len", seq_len), ("packs_per_step", packs_per_step)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DataError(f"Packer: pretrain.{name} must be a whole number >= 1, got {value!r}",
                                fix=f"set pretrain.{name} to a positive integer")
        if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
            raise DataError("Packer: the tokenizer needs an EOS token (the document separator) and a pad token",
                            fix="set tokenizer.pad_token = tokenizer.eos_token (or add the tokens)")
        self.stream, self.tokenizer = stream, tokenizer
        self.seq_len, self.packs_per_step = seq_len, packs_per_step
        self.start_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        self.epoch, self.document, self.offset, self.steps = 0, 0, 0, 0
        self._reader: Iterator[list[int]] | None = None
        self._tokens: list[int] = []  # the current document's tokens (EOS included)

    def _open(self) -> None:
        """Read from document `self.document` on (tokenised one at a time, as the packs need them)."""
        texts = self.stream.documents(self.document)
        self._reader = (self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"] + [self.tokenizer.eos_token_id]
                        for text in texts)

    def _load_document(self) -> None:
        """`_tokens` = document `self.document`'s; past the last one, the next epoch's first."""
        if self._reader is None:
            self._open()
        tokens = next(self._reader, None)
        if tokens is None:
            if self.document == 0:
                raise DataError(f"{self.stream.path}: the corpus holds no documents", fix="point at a non-empty corpus")
            self.epoch, self.document, self.offset = self.epoch + 1, 0, 0
            self._open()
            tokens = next(self._reader, None)
            if tokens is None:
                raise DataError(f"{self.stream.path}: the corpus became empty during the run",
                                fix="keep the corpus unchanged while a run reads it")
        self._tokens = tokens

    def next_pack(self) -> list[list[int]]:
        """The next `seq_len` tokens of the stream, as its segments (one per document it touches)."""
        if self._reader is None:
            self._load_document()
        segments, room = [], self.seq_len
        while room:
            piece = self._tokens[self.offset:self.offset + room]
            segments.append(piece)
            room -= len(piece)
            self.offset += len(piece)
            if self.offset == len(self._tokens):  # the document is done: the next one starts
                self.document, self.offset = self.document + 1, 0
                self._load_document()
        return segments

    def next_batch(self) -> Rollouts:
        """One step: `packs_per_step` packs, each segment a row with the start token as its prompt."""
        segments = [segment for _ in range(self.packs_per_step) for segment in self.next_pack()]
        self.steps += 1
        return segment_batch(segments, self.start_id, self.tokenizer.pad_token_id)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "document": self.document, "offset": self.offset, "steps": self.steps,
                "seq_len": self.seq_len, "packs_per_step": self.packs_per_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        packing = {"seq_len": state.get("seq_len"), "packs_per_step": state.get("packs_per_step")}
        if packing != {"seq_len": self.seq_len, "packs_per_step": self.packs_per_step}:
            raise DataError(f"Packer: the checkpoint's data position was taken with {packing}, this run packs with "
                            f"seq_len={self.seq_len}, packs_per_step={self.packs_per_step}: it would replay other text",
                            fix="resume with the pretrain section the run started with")
        self.epoch, self.document, self.offset, self.steps = (int(state[key]) for key in
                                                             ("epoch", "document", "offset", "steps"))
        self._open()
        tokens = next(self._reader, None)
        if tokens is None or self.offset >= len(tokens):
            raise DataError(f"Packer: the checkpoint's position (document {self.document}, token {self.offset}) is "
                            f"past the end of the corpus {self.stream.path}: it changed since the run started",
                            fix="resume with the corpus the run started with")
        self._tokens = tokens


def segment_batch(segments: list[list[int]], start_id: int, pad_id: int) -> Rollouts:
    """Segments as an SFT batch: prompt = [start_id], response = the segment, right-padded; mask on its tokens."""
    width = max(len(segment) for segment in segments)
    response = torch.full((len(segments), width), pad_id, dtype=torch.long)  # [N, T]
    mask = torch.zeros(len(segments), width, dtype=torch.bool)  # [N, T]
    for row, segment in enumerate(segments):
        response[row, :len(segment)] = torch.tensor(segment, dtype=torch.long)
        mask[row, :len(segment)] = True
    prompts = Prompts(torch.full((len(segments), 1), start_id, dtype=torch.long),
                      torch.ones(len(segments), 1, dtype=torch.bool))  # [N, 1]
    return Rollouts.from_demonstrations(prompts, response, mask)
