"""LoRA for `rlgraph train`: train low-rank adapters (peft) instead of every weight.

    model = apply_lora(build_causal_lm(), LoraSettings(r=8))   # only the adapters require grad
    reference = reference_of(model)      # the KL reference: the same module, adapters off, no weights of its own
    weights = merged_state_dict(model)   # base names, W + B A * alpha / r: for a generator or an export
    settings_of(model)                   # the LoraSettings it was built with (plain data for a worker's RoleSpec)

Why a view for the reference: with LoRA the frozen base *is* the reference policy, so a second
copy (a deepcopy, as full fine-tuning needs) would double the weights in memory and in every
checkpoint for nothing. `reference_of` (a `LoraReference`) runs the policy's own module with every
LoRA layer's adapters switched off for the call (`_layers_off`: the layers' flag only, not peft's
`disable_adapter()`, whose `requires_grad` toggle would leave FSDP2's sharded adapters frozen); it
holds no parameters, so the executor checkpoints nothing for it.
Why adapters only in checkpoints: the base never changes, so it comes back from the model source
on resume (`LocalExecutor.export_state` keeps only the trainable tensors of such a role).
The FSDP2 workers (spmd, ray) use the same pieces over sharded parameters: `base_view` runs the
policy's FSDP2 root with adapters off (the reference), `adapter_deltas` collects what
`merge_adapters` adds to gathered buckets for the generation engine (`fsdp/sync.py`) and to a
merged checkpoint (`fsdp/state.py`).
"""

from __future__ import annotations

import contextlib
import difflib
import warnings
from collections.abc import Iterator, Mapping

import attrs
import torch
from transformers import PreTrainedModel

from rlgraph.errors import ConfigError

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _check_r(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"LoRA r={value!r}: the adapter rank must be a whole number >= 1",
                          fix="r: 8 (typical ranks are 4 to 64)")


def _check_alpha(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ConfigError(f"LoRA alpha={value!r}: the scale numerator must be a finite number > 0 (scale = alpha / r)",
                          fix="alpha: 16 (often 2 * r)")


def _check_dropout(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ConfigError(f"LoRA dropout={value!r}: a probability in [0, 1) is needed", fix="dropout: 0.0 or 0.05")


def _targets(value: object) -> tuple[str, ...]:
    if isinstance(value, str):  # "q_proj" would otherwise become ('q', '_', 'p', ...)
        return (value,)
    return tuple(value) if isinstance(value, (list, tuple)) else value  # type: ignore[return-value]


def _check_targets(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, tuple) or not value or not all(isinstance(name, str) and name for name in value):
        raise ConfigError(f"LoRA target_modules={value!r}: a non-empty list of linear module names is needed",
                          fix=f"target_modules: {list(DEFAULT_TARGETS)}")


@attrs.frozen
class LoraSettings:
    """The adapters: rank `r`, scale `alpha / r`, dropout on the adapter input, and the linear
    modules they wrap (a name matches a module whose name is it or ends in `.name`)."""

    r: int = attrs.field(default=8, validator=_check_r)
    alpha: float = attrs.field(default=16.0, validator=_check_alpha)
    dropout: float = attrs.field(default=0.0, validator=_check_dropout)
    target_modules: tuple[str, ...] = attrs.field(default=DEFAULT_TARGETS, converter=_targets, validator=_check_targets)

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def describe(self) -> str:
        return f"LoRA r={self.r}, alpha={self.alpha:g} on {','.join(self.target_modules)}"


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct short names (`q_proj`, `lm_head`, ...) of `model`'s `nn.Linear` modules."""
    return sorted({name.removesuffix(".base_layer").rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear)})


def _check_targets_exist(model: torch.nn.Module, targets: tuple[str, ...]) -> None:
    """Refuse a target that wraps nothing: peft would either raise deep inside or, for a list where
    other names match, silently train fewer modules than asked."""
    # A peft model's wrapped linears are `<name>.base_layer`: matched under their own `<name>`.
    linear = [name.removesuffix(".base_layer") for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    short = linear_module_names(model)
    for target in targets:
        if not any(name == target or name.endswith("." + target) for name in linear):
            close = difflib.get_close_matches(target, short, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"LoRA target_modules: {target!r} matches no linear module of {type(model).__name__}{hint} "
                              f"(its linear modules: {', '.join(short)})",
                              fix=f"target_modules: {list(DEFAULT_TARGETS)} (attention) or add gate_proj, up_proj, down_proj (MLP)")


def apply_lora(model: PreTrainedModel, settings: LoraSettings, *, seed: int = 0, adapter: str | None = None
               ) -> torch.nn.Module:
    """`model` wrapped by peft with fresh adapters (B = 0, so it computes what `model` computed);
    only the adapter tensors require grad. `model` itself is modified in place (its target
    linears are replaced by LoRA layers), as peft does. A is drawn from a generator seeded with
    `seed` (peft draws from the global RNG, which would make two runs' adapters differ by
    whatever ran before); the global RNG state is left untouched.

    `adapter` names the adapter: on a peft model that already holds named adapters, it is added
    beside them (the service's tenants: one base, one adapter each; `set_adapter` picks the one
    that runs and trains). Without a name, `model` must be plain (one adapter, peft's "default")."""
    from peft import LoraConfig, PeftModel, get_peft_model

    beside = adapter is not None and isinstance(model, PeftModel)
    if is_lora(model) and not beside:
        raise ConfigError(f"apply_lora: {type(model).__name__} already holds LoRA adapters",
                          fix="apply LoRA once, to the plain model (or name each adapter of a shared base)")
    _check_targets_exist(model, settings.target_modules)
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.target_modules), bias="none", task_type="CAUSAL_LM")
    devices = [model.device] if model.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), warnings.catch_warnings():
        torch.manual_seed(seed)
        # peft calls a transformers method that transformers 5 deprecates
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        # A tied lm_head adapted: peft warns that merging would change the embedding too. The
        # merges here (`merge_adapters`) write new tensors and never touch the module.
        warnings.filterwarnings("ignore", message=".*tied.*")
        if beside:
            model.add_adapter(adapter, config)
            lora_model = model
        else:
            lora_model = get_peft_model(model, config, **({} if adapter is None else {"adapter_name": adapter}))
    trainable = [name for name, param in lora_model.named_parameters() if param.requires_grad]
    assert trainable and all(".lora_" in name for name in trainable), trainable[:4]
    return lora_model


def is_lora(module: torch.nn.Module) -> bool:
    """Whether `module` holds peft LoRA layers (a `PeftModel`, or a model they were injected into)."""
    from peft.tuners.lora import LoraLayer

    return any(isinstance(sub, LoraLayer) for sub in module.modules())


def _peft(lora_model: torch.nn.Module, what: str):
    from peft import PeftModel

    if not isinstance(lora_model, PeftModel) or not is_lora(lora_model):
        raise ConfigError(f"{what}: {type(lora_model).__name__} is not a LoRA model",
                          fix="pass the model apply_lora returned")
    return lora_model


def trainable_state(lora_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors that train (the adapters), under the peft model's state-dict names, detached."""
    names = {name for name, param in lora_model.named_parameters() if param.requires_grad}
    return {name: tensor.detach() for name, tensor in lora_model.state_dict().items() if name in names}


def _base_name(name: str) -> str:
    """`q_proj.base_layer.weight` (peft's name for the wrapped weight) -> `q_proj.weight`."""
    return name.replace(".base_layer.", ".")


def plain_name(name: str) -> str | None:
    """A LoRA model's tensor name as the plain model names it (`base_model.model.` and `.base_layer.`
    dropped); None for an adapter tensor, which the plain model does not have."""
    if ".lora_" in name:
        return None
    return _base_name(name.removeprefix("base_model.model."))


@attrs.frozen
class AdapterDelta:
    """One adapter of one wrapped linear, by tensor name: its weight gains `B @ A * scale`."""

    a: str
    b: str
    scale: float
    fan_in_fan_out: bool = False


def adapter_deltas(lora_model: torch.nn.Module) -> dict[str, list[AdapterDelta]]:
    """Plain weight name -> the active, unmerged adapters to add to it, named as in
    `lora_model.named_parameters()` (a PeftModel's names, or the FSDP2-wrapped module's)."""
    from peft.tuners.lora import LoraLayer

    deltas: dict[str, list[AdapterDelta]] = {}
    for name, module in lora_model.named_modules():
        if not isinstance(module, LoraLayer) or module.merged:
            continue  # a merged layer's base weight holds the delta already
        for adapter in module.active_adapters:
            if adapter in module.lora_A:
                deltas.setdefault(plain_name(f"{name}.weight"), []).append(AdapterDelta(
                    f"{name}.lora_A.{adapter}.weight", f"{name}.lora_B.{adapter}.weight",
                    float(module.scaling[adapter]), bool(module.fan_in_fan_out)))
    return deltas


def merge_adapters(tensors: Mapping[str, torch.Tensor], deltas: Mapping[str, list[AdapterDelta]]) -> dict[str, torch.Tensor]:
    """`tensors` (full tensors under a LoRA model's names: whole layers, base and adapters together)
    as the plain model's, with every adapter merged: W + B A * scale (what peft's `get_delta_weight`
    computes). New tensors for the merged weights; the others are `tensors`' own."""
    merged = {plain_name(name): tensor for name, tensor in tensors.items() if plain_name(name) is not None}
    for name, adapters in deltas.items():
        if name not in merged:
            continue  # another bucket's layer
        weight = merged[name]  # [out, in]
        for delta in adapters:
            update = tensors[delta.b].float() @ tensors[delta.a].float()  # [out, r] @ [r, in]
            weight = weight + (update.T if delta.fan_in_fan_out else update).mul(delta.scale).to(weight.dtype)
        merged[name] = weight
    return merged


@torch.no_grad()
def merged_state_dict(lora_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state dict (its names and shapes) with every adapter merged:
    W + B A * alpha / r. New tensors; the live model is untouched (still unmerged, adapters on)."""
    peft_model = _peft(lora_model, "merged_state_dict")
    state = {name: tensor.detach() for name, tensor in peft_model.state_dict().items()}
    return merge_adapters(state, adapter_deltas(peft_model))


def settings_of(lora_model: torch.nn.Module) -> LoraSettings:
    """The settings `apply_lora` built `lora_model` with (its active adapter's peft config)."""
    config = _peft(lora_model, "settings_of").peft_config[lora_model.active_adapter]
    targets = config.target_modules  # peft keeps a list as a set
    return LoraSettings(r=config.r, alpha=config.lora_alpha, dropout=config.lora_dropout,
                        target_modules=targets if isinstance(targets, str) else tuple(sorted(targets)))


@contextlib.contextmanager
def _layers_off(peft_model: torch.nn.Module) -> Iterator[None]:
    """Every LoRA layer computes its base layer alone: peft's `disable_adapter()` without its side
    effect on `requires_grad` (it freezes the adapters, then unfreezes what is registered on exit).
    Under FSDP2 a module holds two parameter objects per tensor (the sharded one and the unsharded
    one it swaps in around a forward), so that toggle would leave the adapters' sharded parameters
    frozen; flipping the layers' flag touches no parameter."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [module for module in peft_model.modules() if isinstance(module, BaseTunerLayer)]
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True  # what BaseTunerLayer.enable_adapters(False) sets, besides requires_grad
    try:
        yield
    finally:
        for layer, was in zip(layers, before):
            layer._disable_adapters = was


class _AdaptersOff(torch.nn.Module):
    """`module`'s forward with the peft model's adapters disabled; holds no parameters (the wrapped
    modules are kept outside the module tree, so `parameters()` and `state_dict()` are empty)."""

    def __init__(self, peft_model: torch.nn.Module, inner: torch.nn.Module):
        super().__init__()
        self._held = (peft_model, inner)  # a tuple: nn.Module does not register what it holds

    @contextlib.contextmanager
    def adapters_off(self) -> Iterator[None]:
        """Adapters off and the shared module in this view's mode (eval for log-probs), then both restored."""
        peft_model, _ = self._held
        was_training = peft_model.training
        peft_model.train(self.training)
        try:
            with _layers_off(peft_model):
                yield
        finally:
            peft_model.train(was_training)

    def forward(self, *args, **kwargs):
        with self.adapters_off():
            return self._held[1](*args, **kwargs)


class LoraReference(_AdaptersOff):
    """The KL reference of a LoRA policy: the policy's module with its adapters off (= the base
    model). What `sequence_logprobs` and `NativeGenerator` read (`config`, `device`, the decoder,
    the embeddings, the forward) is served from the shared module; every forward, the decoder's
    included, runs with the adapters disabled. Not thread-safe: while it runs, the policy's
    adapters are off too (the local executor runs one primitive at a time)."""

    def __init__(self, peft_model: torch.nn.Module):
        super().__init__(peft_model, peft_model)
        self.config = peft_model.get_base_model().config

    @property
    def device(self) -> torch.device:
        return self._held[0].get_base_model().device

    def get_decoder(self) -> torch.nn.Module:
        return _AdaptersOff(self._held[0], self._held[0].get_base_model().get_decoder()).train(self.training)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self._held[0].get_base_model().get_input_embeddings()

    def get_output_embeddings(self) -> torch.nn.Module:
        return self._held[0].get_base_model().get_output_embeddings()

    @property
    def model(self) -> torch.nn.Module:
        """A Qwen2-VL's multimodal body (vision tower + language model) with the adapters off: what
        the VLM forwards (`vlm_forward`) call, where a text model's read `get_decoder()`."""
        return _VisionBodyOff(self._held[0], self._held[0].get_base_model().model).train(self.training)


class _VisionBodyOff(_AdaptersOff):
    """A VLM body's forward, tower and embeddings with a peft model's adapters off."""

    def get_input_embeddings(self) -> torch.nn.Module:
        return self._held[1].get_input_embeddings()

    def get_image_features(self, *args, **kwargs):
        with self.adapters_off():
            return self._held[1].get_image_features(*args, **kwargs)

    def get_rope_index(self, *args, **kwargs):
        return self._held[1].get_rope_index(*args, **kwargs)  # positions: no parameters


def base_view(lora_model: torch.nn.Module, module: torch.nn.Module) -> torch.nn.Module:
    """A module whose forward is `module`'s (a module that runs `lora_model`, e.g. its FSDP2 root)
    with `lora_model`'s adapters off; it holds no parameters. The spmd KL reference of a LoRA policy."""
    return _AdaptersOff(_peft(lora_model, "base_view"), module)


def viewed_model(module: torch.nn.Module) -> torch.nn.Module | None:
    """The LoRA model `module` is an adapters-off view of (`reference_of`, `base_view`), else None."""
    return module._held[0] if isinstance(module, _AdaptersOff) else None


def reference_of(lora_model: torch.nn.Module) -> torch.nn.Module:
    """The KL reference of a LoRA policy: the same module run with adapters disabled. It holds no
    parameters (no second copy in memory or in checkpoints) and gives the base model's log-probs
    and generations."""
    return LoraReference(_peft(lora_model, "reference_of"))
