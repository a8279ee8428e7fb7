"""`rlgraph train` with a `vision:` section: rows carry images from the data file to every primitive
(warm start, GRPO, evaluation), every image is checked before step 1, and what is not built is refused."""

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForImageTextToText

from rlgraph.backends.local.vlm import build_vision_lm, build_vl_tokenizer
from rlgraph.errors import ConfigError
from rlgraph.data.images import ImageError
from rlgraph.train.config import load_config
from rlgraph.train.evaluation import evaluate_run
from rlgraph.train.export import export_run
from rlgraph.train.run import load_run_config, train
from rlgraph.train.setup import prepare
from tests.train.test_run import assert_same_run, policy_weights

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("vision_shapes_data", ROOT / "examples" / "vision_shapes" / "make_data.py")
shapes = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(shapes)  # the example's own drawing: one source of the task


def _write(tmp_path, rows=24, seed=0, text_every=0):
    """`rows` rows of the example's task; with `text_every`, every such row (from the second) has no image."""
    rng = random.Random(seed)
    lines = []
    for i in range(rows):
        uri, colour = shapes.draw(rng)
        image = [] if text_every and i % text_every == 1 else uri
        lines.append(json.dumps({"prompt": "colour=", "image": image, "answer": colour}))
    path = tmp_path / "shapes.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _config(tmp_path, overrides=(), *, rows=24, text_every=0, **sections):
    config = {
        "name": "v", "run_dir": str(tmp_path / "run"),
        "vision": {"pixel_budget": 256},
        "data": {"train": str(_write(tmp_path, rows, text_every=text_every)), "eval_fraction": 0.25,
                 "chat_template": False},
        "rewards": [{"name": "exact_match"}],
        "algorithm": {"name": "grpo", "hparams": {"kl": 0.04}},
        "rollout": {"prompts_per_step": 4, "n": 2, "max_new_tokens": 4},
        "optimizer": {"lr": 1e-3},
        "warm_start": {"steps": 2, "batch_size": 8, "lr": 2e-3},
        "train": {"steps": 2, "seed": 0},
        "runtime": {"threads": 1},
        "checkpoint": {"every": 2, "keep_last": 1},
        "logging": {"tensorboard": False, "progress": False, "plots": False, "samples": 0},
    }
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    path = tmp_path / "v.yaml"
    path.write_text(yaml.safe_dump(config))
    return load_config(path, list(overrides))


def test_a_vision_run_warm_starts_trains_and_evaluates_with_its_images(tmp_path):
    result = train(_config(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert result.steps == 2 and result.eval_before is not None and result.eval_after is not None
    trained = [row for row in rows if "policy/grad_norm" in row]
    assert len(trained) == 2 and all(row["policy/grad_norm"] == row["policy/grad_norm"] for row in trained)
    plan = (tmp_path / "run" / "plan.txt").read_text()
    assert "vision policy: tower" in plan and "pixel budget 256 px" in plan  # the plan counts the images
    # the checkpoint holds the trained language model, the frozen tower comes from the seeded source again
    assert evaluate_run(tmp_path / "run")["eval/accuracy"] == result.eval_after
    exported = AutoModelForImageTextToText.from_pretrained(str(export_run(tmp_path / "run", tmp_path / "hf")))
    assert type(exported).__name__ == "Qwen2VLForConditionalGeneration"
    seeded = build_vision_lm(tokenizer=build_vl_tokenizer(), seed=0).model.visual.state_dict()  # as the run built it
    assert all(torch.equal(seeded[name], tensor) for name, tensor in exported.model.visual.state_dict().items())
    trained = policy_weights(tmp_path / "run")
    assert all(torch.equal(exported.state_dict()[name], tensor) for name, tensor in trained.items())


SPMD = ["runtime.runtime=spmd", "runtime.nproc=2"]


@pytest.mark.parametrize("overrides, message", [
    (["runtime.runtime=ray", "runtime.nproc=2"], r"runtime.runtime=ray: a vision run is tested on the local and spmd "
                                                 r"(.|\n)*fix: runtime.runtime: spmd"),
    ([*SPMD, "model.lora.r=4"], r"model.lora with runtime.runtime=spmd: (.|\n)*fix: runtime.runtime: local for a LoRA"),
    ([*SPMD, "runtime.engine=vllm"], r"runtime.engine: 'vllm' for a vision run .*; vLLM cannot generate for a "
                                     r"vision-language model here: \(1\) .*torchvision.*\n  fix: runtime.engine: native"),
    (["vision.pixel_budget=16"], "vision.pixel_budget: build_image_processor: max_pixels=16 must be an int >= 64"),
])
def test_what_a_vision_run_cannot_do_is_refused_before_a_model_exists(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        prepare(_config(tmp_path, overrides))


@pytest.mark.parametrize("image, message", [
    ("missing.png", r"shapes.jsonl:2, field 'image': image file .*missing.png' does not exist"),
    ("data:image/png;base64,@@@", r"shapes.jsonl:2, field 'image': the inline image is not valid base64"),
    (None, r"shapes.jsonl:2, field 'image': None is not an image reference"),
])
def test_a_bad_image_is_named_by_file_row_and_field_before_step_1(tmp_path, image, message):
    config = _config(tmp_path)
    path = Path(config.data.train)
    lines = path.read_text().splitlines()
    row = json.loads(lines[1])
    row["image"] = image
    lines[1] = json.dumps(row)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ImageError, match=message):
        train(config)
    assert not (tmp_path / "run").exists()  # refused before the run wrote anything, before any model was built


def test_lora_on_a_vision_run_trains_only_the_adapters_and_resumes_exactly(tmp_path):
    """model.lora on the tiny Qwen2-VL (local runtime): the warm start's merged base, then adapters on the
    language model's attention only; the checkpoints hold only the adapters (the tower and the base stay
    in RUN_DIR/base.safetensors, unchanged), the KL reference is the base (adapters off, kl 0.04 here),
    and a run cut at step 1 and resumed equals the uninterrupted run (metrics and weights, exactly)."""
    from safetensors.torch import load_file

    lora = {"lora": {"r": 4}}
    vowel = [{"name": "format_regex", "options": {"pattern": "[aeiou]"}}]  # varies within groups: a gradient
    whole = _config(tmp_path, ["checkpoint.every=1", "checkpoint.keep_last=2", "eval.every=1"], model=lora,
                    rewards=vowel)
    train(whole)
    adapters = policy_weights(tmp_path / "run")
    assert adapters and all(".lora_A." in name or ".lora_B." in name for name in adapters)
    assert not any("visual" in name for name in adapters)  # the tower has no adapters: it is frozen with the base
    assert any(".self_attn.q_proj.lora_B." in name and (tensor != 0).any() for name, tensor in adapters.items())
    base = load_file(str(tmp_path / "run" / "base.safetensors"))
    assert any(name.startswith("model.visual.") for name in base)  # the base holds the tower
    assert 0.0 <= evaluate_run(tmp_path / "run")["eval/accuracy"] <= 1.0  # eval builds base + adapters
    merged = AutoModelForImageTextToText.from_pretrained(str(export_run(tmp_path / "run", tmp_path / "hf"))).state_dict()
    q = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], base[q])  # the adapters merged into the exported weights
    assert all(torch.equal(merged[name], tensor) for name, tensor in base.items() if name.startswith("model.visual."))
    cut_dir = tmp_path / "cut"
    cut_dir.mkdir()
    cut = _config(cut_dir, ["train.steps=1", "checkpoint.every=1", "checkpoint.keep_last=2", "eval.every=1"],
                  model=lora, rewards=vowel)
    train(cut)
    assert train(load_run_config(cut_dir / "run", ["train.steps=2"]), resume=True).steps == 2
    assert_same_run(tmp_path / "run", cut_dir / "run")
    assert load_file(str(cut_dir / "run" / "base.safetensors")).keys() == base.keys()


def test_a_qwen2_5_vl_from_a_local_directory_trains_evaluates_and_exports(tmp_path):
    """The run as above on a tiny Qwen2.5-VL saved with save_pretrained (its windowed tower, RMSNorms):
    `model.path` names the directory, and the export is that architecture with the tower it was given."""
    from tests.backends.test_vlm import tiny_qwen2_5_vl_config

    tokenizer = build_vl_tokenizer()
    model = build_vision_lm(tiny_qwen2_5_vl_config(tokenizer), tokenizer=tokenizer, seed=1)
    model.save_pretrained(tmp_path / "qwen2_5_vl")
    tokenizer.save_pretrained(tmp_path / "qwen2_5_vl")
    result = train(_config(tmp_path, model={"path": str(tmp_path / "qwen2_5_vl")}))
    assert result.steps == 2 and result.eval_after is not None
    exported = AutoModelForImageTextToText.from_pretrained(str(export_run(tmp_path / "run", tmp_path / "hf")))
    assert type(exported).__name__ == "Qwen2_5_VLForConditionalGeneration"
    given = model.model.visual.state_dict()
    assert all(torch.equal(given[name], tensor) for name, tensor in exported.model.visual.state_dict().items())
    trained = policy_weights(tmp_path / "run")
    assert all(torch.equal(exported.state_dict()[name], tensor) for name, tensor in trained.items())
    assert any(not torch.equal(model.state_dict()[name], tensor) for name, tensor in trained.items())  # it trained


@pytest.mark.slow
def test_a_vision_run_on_two_spmd_ranks_equals_the_local_run_and_resumes_on_it(tmp_path):
    """Every other row has no image: spmd step 1 has no image on either rank, step 2 one on rank 1 only
    (checked below from the run's own sampler): a rank without one runs no tower, none waits for it. The
    controller ships each prompt's pixels with its rows (the data are decoded and checked once, before
    step 1). The workers warm-start (1 SFT step), train 2 GRPO steps and evaluate; the run then resumes
    from their checkpoint on the local runtime for step 3. Metrics per step agree within the helpers'
    bounds (`RTOL`: the tiny model's reduction chain; the tower is frozen and each rank runs it on its
    own prompts with the same weights), evaluations exactly (greedy), and the weights after step 3
    within 2 * sum(lr) per element (an element whose gradient is rounding noise can take an AdamW
    step of ~lr on one runtime and not the other: 1 warm step at 2e-3, 3 RL steps at 1e-3)."""
    from rlgraph.data.sampler import Sampler
    from tests.helpers import assert_rows_close
    from tests.train.test_run import metrics_of, train_rows

    common = dict(rows=12, text_every=2, rewards=[{"name": "format_regex", "options": {"pattern": "[aeiou]"}}])
    sizes = ["rollout.prompts_per_step=2", "eval.max_prompts=2", "warm_start.steps=1", "warm_start.batch_size=2", "checkpoint.every=1",
             "checkpoint.keep_last=3"]
    local_dir, spmd_dir = tmp_path / "local", tmp_path / "spmd"
    local_dir.mkdir(), spmd_dir.mkdir()
    local = _config(local_dir, [*sizes, "train.steps=3"], **common)
    train(local)
    train(_config(spmd_dir, [*sizes, "train.steps=2", *SPMD], **common))
    assert not (spmd_dir / "run" / "start_weights").exists()  # the warm-started policy's file is gone
    resumed = load_run_config(spmd_dir / "run", ["train.steps=3", "runtime.runtime=local"])
    assert train(resumed, resume=True).steps == 3
    rows = prepare(local).train_rows
    sampler = Sampler(rows, 2, seed=0)
    has_image = [[bool(row.fields["image"]) for row in sampler.next_batch()] for _ in range(3)]
    # the spmd steps: no image on either rank, then an image on one rank only (the local step 3: on both)
    assert has_image == [[False, False], [False, True], [True, True]], has_image
    assert_rows_close(train_rows(spmd_dir / "run"), train_rows(local_dir / "run"))
    assert min(row["policy/grad_norm"] for row in train_rows(local_dir / "run")) > 0  # every step moved the policy
    def evaluations(run_dir):  # step -> greedy accuracy and length (the spmd run also evaluated where it stopped)
        return {row["step"]: (row["eval/accuracy"], row["eval/response_length"])
                for row in metrics_of(run_dir) if "eval/accuracy" in row}

    want = evaluations(local_dir / "run")
    assert sorted(want) == [0, 3] and {step: evaluations(spmd_dir / "run")[step] for step in want} == want
    want, got = policy_weights(local_dir / "run"), policy_weights(spmd_dir / "run")
    assert want.keys() == got.keys() and not any("visual" in name for name in got)  # the frozen tower is not saved
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=2 * (2e-3 + 3 * 1e-3))
