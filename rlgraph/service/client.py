"""The in-process client: the Tinker SDK's call names on a `Service`, without HTTP (tests,
notebooks, and the identical-results check against the HTTP server).

    service = LocalServiceClient("tiny", state_dir="states")
    training = service.create_lora_training_client("tiny", rank=8).result()
    training.forward_backward(data, "cross_entropy").result()      # Tinker Datum or rlgraph Datum
    training.optim_step({"learning_rate": 1e-4}).result()          # or tinker.types.AdamParams
    sampler = training.save_weights_and_get_sampling_client().result()
    sampler.sample(prompt, num_samples=4, sampling_params=SampleParams(max_tokens=8)).result()

Calls return futures (`.result()`), run on the same scheduler as the server's (fair, ordered),
and accept the SDK's types where it is installed (duck-typed: `ModelInput.to_ints()`,
`TensorData.to_numpy()`), so one loop runs against either client. Any loss of rlgraph's registry
is usable by name here (`F.register_loss`), beyond Tinker's five.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import attrs
import torch

from rlgraph.service import programs
from rlgraph.service.core import SampleParams, Service
from rlgraph.service.datums import Datum
from rlgraph.service.scheduler import Scheduler
from rlgraph.service.tenants import LoraSpec


@attrs.frozen
class ForwardBackwardResult:
    """Per datum {"logprobs", "elementwise_loss"} as tensors [L]; metrics {"loss:sum"}."""

    loss_fn_outputs: list[dict[str, torch.Tensor]]
    metrics: dict[str, float]


@attrs.frozen
class SampleResult:
    sequences: list[Any]  # each .tokens, .logprobs, .stop_reason
    prompt_logprobs: list[float | None] | None


@attrs.frozen
class PathResult:
    path: str | None


def as_tokens(model_input: Any) -> list[int]:
    """A Tinker `ModelInput` (`to_ints()`), a tensor or a list, as token ids."""
    if hasattr(model_input, "to_ints"):
        return list(model_input.to_ints())
    if isinstance(model_input, torch.Tensor):
        return model_input.tolist()
    return list(model_input)


def as_datum(datum: Any) -> Datum:
    if isinstance(datum, Datum):
        return datum
    inputs = {name: value.to_numpy() if hasattr(value, "to_numpy") else value
              for name, value in datum.loss_fn_inputs.items()}
    return Datum(as_tokens(datum.model_input), inputs)


def as_adam(params: Any) -> dict[str, float]:
    if params is None:
        return {}
    if isinstance(params, Mapping):
        return dict(params)
    return {key: getattr(params, key) for key in ("learning_rate", "beta1", "beta2", "eps", "weight_decay",
                                                   "grad_clip_norm") if hasattr(params, key)}


def as_params(params: Any) -> SampleParams:
    if isinstance(params, SampleParams):
        return params
    if isinstance(params, Mapping):
        return SampleParams(**params)
    fields = ("max_tokens", "seed", "stop", "temperature", "top_k", "top_p")
    return SampleParams(**{key: getattr(params, key) for key in fields if hasattr(params, key)})


class LocalServiceClient:
    """A `Service` and its scheduler in this process, for one owner (`owner`: any string)."""

    def __init__(self, model: str = "tiny", *, state_dir: str | Path, owner: str = "local",
                 service: Service | None = None, scheduler: Scheduler | None = None):
        self.service = service or Service(model, state_dir=state_dir)
        self.scheduler = scheduler or Scheduler()
        self.owner = owner
        self.session = uuid.uuid4().hex
        self._models = itertools.count()
        self._samplers = itertools.count()

    def _submit(self, queue: str, call: Any) -> Future:
        return self.scheduler.future(self.scheduler.submit(queue, call))

    def get_server_capabilities(self) -> dict[str, Any]:
        return {"supported_models": [{"model_name": self.service.base.name, "trainable": True, "sampleable": True,
                                      "max_context_length": self.service.limits.max_tokens}]}

    def create_lora_training_client(self, base_model: str, rank: int = 32, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True,
                                    train_unembed: bool = True) -> Future:
        model_id = f"{self.session}:train:{next(self._models)}"
        lora = LoraSpec(rank=rank, seed=0 if seed is None else seed, train_attn=train_attn, train_mlp=train_mlp,
                        train_unembed=train_unembed)

        def call() -> LocalTrainingClient:
            self.service.create_model(self.owner, model_id, base_model, lora)
            return LocalTrainingClient(self, model_id)
        return self._submit(model_id, call)

    def create_training_client_from_state(self, path: str) -> Future:
        return self._from_state(path, optimizer=False)

    def create_training_client_from_state_with_optimizer(self, path: str) -> Future:
        return self._from_state(path, optimizer=True)

    def _from_state(self, path: str, *, optimizer: bool) -> Future:
        model_id = f"{self.session}:train:{next(self._models)}"

        def call() -> LocalTrainingClient:
            self.service.create_from_state(self.owner, model_id, path, optimizer=optimizer)
            return LocalTrainingClient(self, model_id)
        return self._submit(model_id, call)

    def plan(self, call: str, **settings: Any) -> str:
        """The compiled plan(s) the call `call` runs with `settings` (the call's own keywords:
        loss_fn, loss_fn_config, adam_params, num_samples, sampling_params, include_prompt_logprobs;
        model_id for a training call), as text: the traced program, then the placement plan.
        Nothing runs."""
        if "sampling_params" in settings and settings["sampling_params"] is not None:
            settings["sampling_params"] = as_params(settings["sampling_params"])
        if "adam_params" in settings:
            settings["adam_params"] = as_adam(settings["adam_params"])
        return programs.as_text(self.service.plan(call, owner=self.owner, **settings))

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None) -> Future:
        sampler_id = f"{self.session}:sample:{next(self._samplers)}"

        def call() -> LocalSamplingClient:
            self.service.create_sampler(self.owner, sampler_id, model_path=model_path, base_model=base_model)
            return LocalSamplingClient(self, sampler_id)
        return self._submit(sampler_id, call)


class LocalTrainingClient:
    def __init__(self, client: LocalServiceClient, model_id: str):
        self.client, self.model_id = client, model_id
        self.service = client.service

    def _submit(self, call: Any) -> Future:
        return self.client._submit(self.model_id, call)

    def forward(self, data: Sequence[Any], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None) -> Future:
        return self._forward(data, loss_fn, loss_fn_config, backward=False)

    def forward_backward(self, data: Sequence[Any], loss_fn: str,
                         loss_fn_config: Mapping[str, float] | None = None) -> Future:
        return self._forward(data, loss_fn, loss_fn_config, backward=True)

    def _forward(self, data: Sequence[Any], loss_fn: str, config: Mapping[str, float] | None, *, backward: bool) -> Future:
        datums = [as_datum(datum) for datum in data]
        owner = self.client.owner

        def call() -> ForwardBackwardResult:
            result = self.service.forward(owner, self.model_id, datums, loss_fn, config, backward=backward)
            return ForwardBackwardResult(result["outputs"], result["metrics"])
        return self._submit(call)

    def optim_step(self, adam_params: Any = None) -> Future:
        adam = as_adam(adam_params)
        return self._submit(lambda: {"metrics": self.service.optim_step(self.client.owner, self.model_id, adam)})

    def save_state(self, name: str, overwrite: bool = False) -> Future:
        return self._submit(lambda: PathResult(self.service.save_state(self.client.owner, self.model_id, name,
                                                                       overwrite=overwrite)))

    def load_state(self, path: str) -> Future:
        return self._submit(lambda: PathResult(self.service.load_state(self.client.owner, self.model_id, path,
                                                                       optimizer=False)))

    def load_state_with_optimizer(self, path: str) -> Future:
        return self._submit(lambda: PathResult(self.service.load_state(self.client.owner, self.model_id, path,
                                                                       optimizer=True)))

    def save_weights_for_sampler(self, name: str) -> Future:
        sampler_id = f"{self.client.session}:sample:{next(self.client._samplers)}"
        call = lambda: PathResult(self.service.save_for_sampler(self.client.owner, self.model_id, sampler_id, name)[0])  # noqa: E731
        return self._submit(call)

    def save_weights_and_get_sampling_client(self) -> Future:
        sampler_id = f"{self.client.session}:sample:{next(self.client._samplers)}"

        def call() -> LocalSamplingClient:
            self.service.save_for_sampler(self.client.owner, self.model_id, sampler_id)
            return LocalSamplingClient(self.client, sampler_id)
        return self._submit(call)

    def get_info(self) -> dict[str, Any]:
        return self.service.info(self.client.owner, self.model_id)

    def plan(self, call: str = "forward_backward", **settings: Any) -> str:
        """The plan(s) `call` runs on this model (`LocalServiceClient.plan`)."""
        return self.client.plan(call, model_id=self.model_id, **settings)

    def get_tokenizer(self) -> Any:
        return self.service.base.tokenizer


class LocalSamplingClient:
    def __init__(self, client: LocalServiceClient, sampler_id: str):
        self.client, self.sampler_id = client, sampler_id
        self.service = client.service

    def sample(self, prompt: Any, num_samples: int, sampling_params: Any,
               include_prompt_logprobs: bool = False) -> Future:
        tokens, params = as_tokens(prompt), as_params(sampling_params)

        def call() -> SampleResult:
            result = self.service.sample(self.client.owner, self.sampler_id, tokens, num_samples, params,
                                         prompt_logprobs=include_prompt_logprobs)
            return SampleResult(result["sequences"], result["prompt_logprobs"])
        return self.client._submit(self.sampler_id, call)

    def plan(self, call: str = "sample", **settings: Any) -> str:
        """The plan(s) `call` runs on this sampler (`LocalServiceClient.plan`)."""
        self.service.sampler(self.client.owner, self.sampler_id)
        return self.client.plan(call, **settings)

    def compute_logprobs(self, prompt: Any) -> Future:
        future: Future = Future()
        inner = self.sample(prompt, 1, SampleParams(max_tokens=1), include_prompt_logprobs=True)
        inner.add_done_callback(lambda done: future.set_exception(done.exception()) if done.exception()
                                else future.set_result(done.result().prompt_logprobs))
        return future

    def get_tokenizer(self) -> Any:
        return self.service.base.tokenizer
