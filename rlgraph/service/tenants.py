"""The tenants of one base model: each a LoRA adapter (peft, one named adapter per tenant in the
one shared module), its own AdamW state, random streams and version counter, run by its own
`LocalExecutor` over the shared module.

    base = BaseModel.build("tiny")
    tenant = base.add_tenant("m1", owner, LoraSpec(rank=8, seed=0))
    with base.active(tenant.adapter): programs.run(plan, tenant.executor, batch)   # only this adapter trains

Why one module and named adapters: the base weights are held once, whatever the number of
tenants; a call activates its tenant's adapter (`set_adapter` also makes only that adapter
require grad), and calls run one at a time (`scheduler.py`), so a call sees exactly its adapter.
Tinker splits a step in two calls (`forward_backward` adds gradients, `optim_step` applies
them): the service's plans run `update(step=False)`, which only accumulates, and
`optimizer_step`, which steps the tenant's AdamW (`programs.py`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from rlgraph.backends.local.state import LMWorker
from rlgraph.backends.local.executor import LocalExecutor, require_device
from rlgraph.backends.local.models import load_tokenizer
from rlgraph.backends.world import RoleSpec
from rlgraph.service.errors import CallError

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)
LORA_ALPHA = 32.0  # Tinker's adapters are scaled alpha / rank with a fixed alpha
MAX_RANK = 128


@attrs.frozen
class LoraSpec:
    """Tinker's `LoraConfig`: rank, init seed and which layer families get LoRA adapters: attention,
    MLP and, with `train_unembed` (Tinker's default, "add lora to the unembedding layer"), the LM
    head `lm_head`. The log-prob head multiplies by the head's adapted weight
    (`backends/local/logprobs.py`), so an unembedding adapter trains like the others."""

    rank: int
    seed: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def __attrs_post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 1 <= self.rank <= MAX_RANK:
            raise CallError(f"rank must be a whole number in 1..{MAX_RANK}, got {self.rank!r}", field="lora_config.rank",
                            fix="rank=8 (typical ranks are 8 to 64)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise CallError(f"seed must be an integer, got {self.seed!r}", field="lora_config.seed")
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise CallError("adapts no layer: train_attn, train_mlp and train_unembed are all false",
                            field="lora_config", fix="train_attn=True")

    @property
    def targets(self) -> tuple[str, ...]:
        return (ATTENTION if self.train_attn else ()) + (MLP if self.train_mlp else ()) \
            + (UNEMBED if self.train_unembed else ())

    @property
    def settings(self) -> Any:
        """The adapter as `rlgraph.backends.lora` builds it: alpha fixed (Tinker's scale), no dropout."""
        from rlgraph.backends.lora import LoraSettings

        return LoraSettings(r=self.rank, alpha=LORA_ALPHA, dropout=0.0, target_modules=self.targets)

    @property
    def plan_settings(self) -> dict[str, Any]:
        """The adapter as `rg.compile(lora=...)` sizes it (the plan's memory of a LoRA tenant)."""
        return {"r": self.rank, "target_modules": self.targets}


class TenantExecutor(LocalExecutor):
    """A `LocalExecutor` whose gradient norm is its own adapter's (the shared module also holds
    other tenants' adapters, whose pending gradients are not this tenant's)."""

    def __init__(self, *args: Any, params: list[torch.nn.Parameter], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.params = params

    def _clip_grads(self, worker: LMWorker, clip: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.params, clip))


@attrs.define(eq=False)
class Tenant:
    """A training client's state on the server. `steps` counts optimizer steps (the weights' version)."""

    model_id: str
    owner: str
    adapter: str
    lora: LoraSpec
    executor: TenantExecutor | None  # None when the tenants live on worker ranks (`service/host.py`)
    optimizer: torch.optim.AdamW | None
    steps: int = 0
    snapshots: list[str] = attrs.field(factory=list)  # its sampler ids, oldest first

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.executor.params


@attrs.define(eq=False)
class Sampler:
    """Frozen weights to sample from: a snapshot adapter, or the base model (`adapter=None`)."""

    sampler_id: str
    owner: str
    adapter: str | None
    executor: LocalExecutor | None  # None when the samplers live on worker ranks
    model_path: str | None = None
    key: str | None = None  # its name where the samplers live (`service/host.py`): the adapter, or a base sampler's own


class BaseModel:
    """One base model, its tokenizer, and the adapters of every tenant and sampler snapshot."""

    def __init__(self, name: str, module: torch.nn.Module, tokenizer: Any, *, tokenizer_dir: Path,
                 device: torch.device = torch.device("cpu")):
        self.name = name
        self.device = device
        self.module = module.to(device)  # the plain model until the first adapter, then the PeftModel around it
        self.tokenizer = tokenizer
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = int(module.get_input_embeddings().num_embeddings)
        self.context = int(getattr(module.config, "max_position_embeddings", 2048))
        for param in module.parameters():
            param.requires_grad_(False)  # the base never trains; only adapters do

    @classmethod
    def build(cls, source: str = "tiny", *, seed: int = 0, device: str = "cpu") -> BaseModel:
        """`tiny` (the shipped tiny Qwen2 and character tokenizer), a model config file (`.json`: that
        architecture, random init, the shipped tokenizer) or a local Hugging Face directory
        holding the model and its tokenizer, on `device` (built on the CPU: the same weights anywhere).
        On CUDA the executors run the forwards under bf16 autocast (untested: no GPU here)."""
        from rlgraph.backends.local.models import ASSETS

        place = require_device(device)
        if source == "tiny":
            tokenizer = load_tokenizer()
            return cls("tiny", RoleSpec(seed=seed).build_module(tokenizer), tokenizer,
                       tokenizer_dir=Path(ASSETS).resolve() / "char_tokenizer", device=place)
        path = Path(source).expanduser().resolve()
        if path.suffix == ".json" and path.is_file():  # a config alone: random init, the shipped tokenizer
            tokenizer = load_tokenizer()
            try:
                module = RoleSpec(source=path, seed=seed).build_module(tokenizer)
            except ValueError as exc:  # not JSON, no model_type, a vocabulary smaller than the tokenizer's
                raise CallError(f"{source} is not a model config this server can build: {exc}", field="--model",
                                fix="a Hugging Face config.json with model_type and vocab_size >= the shipped "
                                    "tokenizer's (rlgraph/assets/tiny_qwen2_vllm.json is one)") from None
            return cls(str(path), module, tokenizer, tokenizer_dir=Path(ASSETS).resolve() / "char_tokenizer",
                       device=place)
        if not (path / "config.json").is_file():
            raise CallError(f"{source!r} is neither 'tiny', a model config (.json) nor a model directory with a "
                            "config.json", field="--model",
                            fix="--model tiny, --model rlgraph/assets/tiny_qwen2_vllm.json (its head_dim suits vLLM's "
                                "CPU attention), or --model /path/to/hf_model (config, weights and tokenizer files)")
        tokenizer = load_tokenizer(path)
        return cls(str(path), RoleSpec(source=path, seed=seed).build_module(tokenizer), tokenizer, tokenizer_dir=path,
                   device=place)

    def add_adapter(self, adapter: str, lora: LoraSpec) -> list[torch.nn.Parameter]:
        """A fresh adapter named `adapter` (B = 0: it computes what the base computes); its parameters.
        Built by the one LoRA builder (`rlgraph.backends.lora.apply_lora`), seeded with the tenant's seed."""
        from rlgraph.backends.lora import apply_lora

        self.module = apply_lora(self.module, lora.settings, seed=lora.seed, adapter=adapter)
        return [param for name, param in self.module.named_parameters() if f".{adapter}." in name]

    def delete_adapter(self, adapter: str) -> None:
        self.module.delete_adapter(adapter)

    @contextlib.contextmanager
    def active(self, adapter: str | None) -> Iterator[None]:
        """Calls inside see `adapter` (None: the base, every adapter off)."""
        if adapter is None:
            if hasattr(self.module, "disable_adapter"):
                with self.module.disable_adapter():
                    yield
            else:
                yield
            return
        self.module.set_adapter(adapter)
        yield

    def adapter_state(self, adapter: str) -> dict[str, torch.Tensor]:
        """The adapter's tensors under names without the adapter's name (`...q_proj.lora_A.weight`),
        so a state loads into any tenant's adapter of the same shape."""
        marker = f".{adapter}."
        return {name.replace(marker, "."): param.detach().clone()
                for name, param in self.module.named_parameters() if marker in name}

    def load_adapter_state(self, adapter: str, tensors: Mapping[str, torch.Tensor], where: str) -> None:
        """Copy `tensors` (names from `adapter_state`) into `adapter`, all or nothing."""
        own = {name.replace(f".{adapter}.", "."): param for name, param in self.module.named_parameters()
               if f".{adapter}." in name}
        if set(own) != set(tensors) or any(own[n].shape != tensors[n].shape for n in own):
            raise CallError(f"the saved adapter does not fit this model's adapter (other rank or layers: saved "
                            f"{len(tensors)} tensors, this adapter {len(own)})", field=where,
                            fix="load into a training client created with the same rank and train_* flags, or use "
                                "create_training_client_from_state")
        bad = next((name for name, tensor in tensors.items() if not bool(torch.isfinite(tensor).all())), None)
        if bad is not None:
            raise CallError(f"the saved adapter's {bad} holds non-finite values (NaN or inf); nothing was loaded",
                            field=where, fix="load an earlier state")
        with torch.no_grad():
            for name, param in own.items():
                param.copy_(tensors[name])

    def executor(self, params: list[torch.nn.Parameter], optimizer: Any, *, seed: int,
                 max_new_tokens: int) -> TenantExecutor:
        worker = LMWorker(self.module, optimizer)
        return TenantExecutor({"policy": worker}, {}, self.tokenizer, max_new_tokens=max_new_tokens, seed=seed,
                              params=params, device=self.device)


NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_name(name: object, field: str) -> str:
    """A checkpoint name safe as a file name: letters, digits, '.', '_', '-', at most 64, no path."""
    if not isinstance(name, str) or not NAME.match(name) or ".." in name:
        raise CallError(f"{name!r} is not a checkpoint name: use 1-64 letters, digits, '.', '_' or '-', starting with a "
                        "letter or digit", field=field, fix="save_state('step-10')")
    return name
