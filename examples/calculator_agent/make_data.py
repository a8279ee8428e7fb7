"""Write the calculator agent's data, tokenizer and model config (the files in this folder).

    python examples/calculator_agent/make_data.py

- train.jsonl / test.jsonl: two-digit products "A*B=" with the answer, and for the warm start a
  tool-use trace: the call, the calculator's answer (the environment's turn), the final answer.
  Every pair appears once: `test_size` in test.jsonl, the rest in train.jsonl (a seeded shuffle).
- tokenizer/: the shipped character tokenizer plus "<", ">", "/" and the newline, which the plain
  tool-call format (<tool>calculator(A*B)</tool>) and its answers (<result>...</result>) need.
- model/config.json: the shipped tiny Qwen2 sized for that vocabulary and longer episodes, wider
  (128) and with 3 layers (no weights: the run initialises it from its seed).
"""

import json
import random
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
ASSETS = HERE.parents[1] / "rlgraph" / "assets"
EXTRA = ["<", ">", "/", "\u010a"]  # byte-level spellings: "\u010a" is the newline


def write_data(seed: int = 0, test_size: int = 200) -> None:
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    rows = [{"question": f"{a}*{b}=", "answer": str(a * b),
             "trace": [f"<tool>calculator({a}*{b})</tool>", str(a * b), str(a * b)]} for a, b in pairs]
    for name, part in (("test.jsonl", rows[:test_size]), ("train.jsonl", rows[test_size:])):
        (HERE / name).write_text("".join(json.dumps(row) + "\n" for row in part))


def write_tokenizer() -> int:
    out = HERE / "tokenizer"
    shutil.copytree(ASSETS / "char_tokenizer", out, dirs_exist_ok=True)
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    for token in EXTRA:
        vocab.setdefault(token, len(vocab))
    (out / "tokenizer.json").write_text(json.dumps(spec, indent=1, ensure_ascii=False))
    settings = json.loads((out / "tokenizer_config.json").read_text())
    settings["model_max_length"] = 128  # prompt and every turn of an episode
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    return len(vocab)


def write_model_config(vocab: int) -> None:
    config = json.loads((ASSETS / "tiny_qwen2.json").read_text())
    # wider and one layer deeper than the shipped tiny Qwen2: at width 64 it copies digits (the operands
    # into the call, the result back) too unreliably for sampled episodes to succeed (docs/agents.md)
    config.update(vocab_size=vocab, max_position_embeddings=128, hidden_size=128, intermediate_size=512,
                  num_hidden_layers=3)
    (HERE / "model").mkdir(exist_ok=True)
    (HERE / "model" / "config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    write_data()
    write_model_config(write_tokenizer())
