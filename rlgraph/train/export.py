"""`rlgraph export RUN_DIR OUT`: a run's trained policy as a Hugging Face directory.

OUT holds `model.safetensors`, `config.json`, `generation_config.json` and the tokenizer, so
`AutoModelForCausalLM.from_pretrained(OUT)` loads it and generates, and `AutoTokenizer.from_pretrained(OUT)`
encodes and decodes as the run's tokenizer did (checked before the export is kept). A LoRA run is exported merged
(base + B A scale, a plain model) by default, or with `adapter=True` as a peft adapter directory
beside the base model's name.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from rlgraph.backends.local.models import auto_tokenizer_mismatch
from rlgraph.backends.local.vlm import build_language_model
from rlgraph.errors import ConfigError
from rlgraph.train.checkpoint import load_weights, resolve_checkpoint
from rlgraph.train.modes import follow_umask

EXPORT_MARK = "rlgraph_export.txt"  # written into every export: what --overwrite may replace


def export_run(run_dir: str | Path, out: str | Path, *, checkpoint: str | Path | None = None,
               adapter: bool = False, overwrite: bool = False, check_tokenizer: bool = True) -> Path:
    """Write the policy of `checkpoint` (default: the run's latest) to `out`; returns `out`.

    With `check_tokenizer`, an export whose tokenizer `AutoTokenizer.from_pretrained(out)` would
    load differently (see `auto_tokenizer_mismatch`) is refused.

    The directory is written to a temporary sibling and renamed, so a failed export leaves nothing.
    """
    from rlgraph.train.roles import BASE_FILE, checkpoint_policy, policy_spec
    from rlgraph.train.run import load_run_config
    from rlgraph.train.setup import _tokenizer

    run_dir, out = Path(run_dir), Path(out)
    config = load_run_config(run_dir)
    path = resolve_checkpoint(run_dir, checkpoint)
    resolved = out.resolve()
    if resolved == run_dir.resolve() or resolved in run_dir.resolve().parents:
        raise ConfigError(f"export target {out} is the run directory {run_dir} or holds it; exporting there would "
                          "replace the run", fix=f"choose a directory outside it, e.g. {run_dir}-hf")
    if out.exists() and not overwrite:
        raise ConfigError(f"export target {out} already exists", fix="choose a new directory or pass --overwrite")
    if out.exists() and not (out.is_dir() and not out.is_symlink() and (out / EXPORT_MARK).is_file()):
        raise ConfigError(f"export target {out} exists and is not an export rlgraph wrote (it has no {EXPORT_MARK}); "
                          "--overwrite replaces only an earlier export, never another directory or file",
                          fix=f"choose a new directory, or move {out} away yourself")
    if adapter and config.model.lora is None:
        raise ConfigError("--adapter: the run trained full weights, not LoRA adapters", fix="export without --adapter")
    if adapter and (run_dir / BASE_FILE).is_file():
        raise ConfigError(f"--adapter: the run's adapters apply to its warm-started base ({run_dir / BASE_FILE}), "
                          f"not to {config.model.path or 'the model it started from'}",
                          fix="export without --adapter (merged weights)")
    tokenizer = _tokenizer(config)
    model, step = checkpoint_policy(config, tokenizer, path)
    if config.model.lora is not None and not adapter:  # a plain model: the adapters merged into the base
        from rlgraph.backends.lora import merged_state_dict

        merged = merged_state_dict(model)
        # the policy's own source: a vision run's Qwen2-VL (the shipped tiny one when model.path is null)
        model = build_language_model(policy_spec(config).source, tokenizer=tokenizer, seed=config.train.seed)
        load_weights(model, merged, path, strict=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        model.eval().save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        problem = auto_tokenizer_mismatch(tokenizer, tmp) if check_tokenizer else None
        if problem:
            raise ConfigError(f"export {out}: {problem.replace(str(tmp), str(out))}; the exported model would answer "
                              "differently from the run", fix=TOKENIZER_FIX)
        (tmp / EXPORT_MARK).write_text(f"run {run_dir}\ncheckpoint {path.name} (step {step})\n"
                                                f"algorithm {config.algorithm.name}\n")
        follow_umask(tmp)  # mkdtemp makes 0700: an export is as readable as any file the user writes
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


TOKENIZER_FIX = ("train with a tokenizer built the way that class rebuilds it (for a qwen2 model: byte-level BPE, Qwen2's "
                 "split regex, NFC; see rlgraph.backends.local.models.build_char_tokenizer), or export with "
                 "check_tokenizer=False and load the tokenizer with PreTrainedTokenizerFast.from_pretrained(OUT)")
