"""The local executor: every role in this process, on its `device` (the CPU, or one local GPU).

Holds the live weights of each role and runs the five primitives:
- `generate` with the native KV-cache engine; `rollout` (multi-turn) with it and the environment
  recipes in `envs`, whose steps run here, in the generating process (`multiturn.py`), or, when the
  plan says `env_workers=k`, in k supervised worker processes of this one (`rlgraph.agents.workers`);
- `logprobs` / `values` without gradients (reference log-probs, old log-probs, critic values);
- `score` by decoding responses and calling the reward function;
- `update`: epochs x mini-batches x micro-batches of the loss closure, gradient accumulation,
  gradient clipping and one optimizer step per mini-batch; bumps the role's version.

Devices: the models live on `device`. A primitive moves its inputs there and returns its outputs
on the device its inputs came from, so the eager interpreter (whose values live on the CPU) runs
against a CUDA executor unchanged, and a worker whose values are on the device already never
copies. On CUDA the forwards (generation, log-probs, values, the training forward) run under bf16
autocast over the fp32 weights (fp32 master weights, gradients and optimizer state); log-probs
stay fp32 (the chunked head upcasts). On the CPU everything is fp32. The CUDA path is written
against documented PyTorch APIs and is untested here: no GPU was available (tests/gpu).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import math

import attrs
import torch

from rlgraph.backends.local.decode_compile import (CompileLedger, Decision, DecodeCompile, model_signature,
                                                  padded_width)
from rlgraph.backends.local.generation import NativeGenerator, cut_at_stop, token_id
from rlgraph.backends.local.counter_sampling import SamplingParams, SamplingStream
from rlgraph.backends.local.lean_decode import lean_unsupported
from rlgraph.backends.local.logprobs import head_fits_one_block, role_outputs
from rlgraph.backends.local.multiturn import TurnLimits, multi_turn_rollouts
from rlgraph.backends.local.packing import pack_rows, row_tokens
from rlgraph.backends.local.vlm import image_encoder
from rlgraph.backends.local.vlm_forward import is_vision_lm
from rlgraph.backends.protocols import EnvRef, ExecutorState, LossFn, ModelRef, RewardRef, RoleState, UpdateConfig
from rlgraph.errors import ConfigError, RewardError
from rlgraph.batches import Prompts, Rollouts, check_token_ids, to_device
from rlgraph.backends.local.state import (
    LMWorker, optimizer_kind, check_role_state, checkpoint_weights, load_checkpoint_weights,
)
from rlgraph.backends.local.training import NonFiniteUpdate, TrainingEpochs, set_mode, split_rows


class StaleVersionError(RuntimeError):
    """A primitive asked for a model version that is not the live one."""


def _check_ids(worker: Any, rollouts: Rollouts, where: str) -> None:
    """Out-of-vocabulary ids given to the runtime are refused by sample, not left to the embedding's IndexError."""
    for module in (worker.model, getattr(worker.model, "backbone", None)):  # a critic wraps its backbone
        embeddings = getattr(module, "get_input_embeddings", None)
        if embeddings is not None:
            check_token_ids(rollouts, embeddings().num_embeddings, where)
            return


@attrs.define
class RewardWorker:
    """A reward role: `fn(completions: list[str], **meta) -> list[float]`."""

    fn: Callable[..., Any]


def check_tokenizer(tokenizer: Any, where: str | None = None) -> Any:
    """Refuse a tokenizer with no EOS or pad id when the executor is built (or, with `where`, the
    config key that named it, before a run loads its data), not mid-run."""
    for name in ("eos_token_id", "pad_token_id"):
        token_id(getattr(tokenizer, name, None), name, where or f"tokenizer {type(tokenizer).__name__}")
    return tokenizer


class LocalExecutor(TrainingEpochs):
    """Every role of `models` on `device` (their modules must be there already)."""

    def __init__(self, models: Mapping[str, LMWorker], rewards: Mapping[str, RewardWorker], tokenizer: Any, *,
                 max_new_tokens: int = 16, seed: int = 0, device: torch.device | str = "cpu",
                 envs: Mapping[str, Callable[[], Any]] | None = None,
                 decode_compile: DecodeCompile | str | bool = "off", compile_train: bool = False):
        self.models = dict(models)
        # whether the decode step compiles (per shape), and this executor's compiles and their seconds
        self.decode_ledger = CompileLedger(DecodeCompile.of(decode_compile))
        self.rewards = dict(rewards)
        self.envs = dict(envs or {})  # env role -> recipe: a picklable callable building one environment
        self.env_workers: dict[str, Any] = {}  # env role -> its EnvWorkers, kept across rollouts (started once)
        self.tokenizer = check_tokenizer(tokenizer)
        self.max_new_tokens = max_new_tokens
        self.generator = torch.Generator().manual_seed(seed)  # mini-batch shuffling, on the CPU whatever the device
        self.sampling = SamplingStream(seed)  # generation: counter-based, one call per generate
        self.device = require_device(device)
        # bf16 autocast over fp32 weights on CUDA; None: compute in the weights' dtype. The FSDP2
        # executor passes no device (it has its own MixedPrecisionPolicy), so it stays None there.
        self.compute_dtype: torch.dtype | None = torch.bfloat16 if self.device.type == "cuda" else None
        # `update`'s forwards (and their backwards) under torch.compile (`train_compile.py`; `train.compile`)
        self.compile_train = compile_train
        self._inference_only_roles: dict[str, bool] = {}  # `_inference_only`, per role

    def _autocast(self) -> contextlib.AbstractContextManager:
        """The forwards' precision: autocast to `compute_dtype`, or nothing (fp32 on the CPU, as before)."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    # -- versions ----------------------------------------------------------------------------
    def current(self, role: str) -> ModelRef:
        return ModelRef(role, self._worker(role).version)

    def _worker(self, role: str) -> LMWorker:
        if role not in self.models:
            raise KeyError(f"the local executor has no model role {role!r}; it has {', '.join(self.models)}")
        return self.models[role]

    def set_learning_rate(self, role: str, lr: float) -> bool:
        """Set every parameter group of `role`'s optimizer to `lr` (a schedule's value for the next
        step); False when this executor holds no trainable `role`."""
        worker = self.models.get(role)
        if worker is None or worker.optimizer is None:
            return False
        for group in worker.optimizer.param_groups:
            group["lr"] = lr
        return True

    def _live(self, ref: ModelRef) -> LMWorker:
        worker = self._worker(ref.role)
        if ref.version != worker.version:
            raise StaleVersionError(
                f"{ref} was requested but {ref.role}@{worker.version} is live; the local executor keeps one version"
            )
        return worker

    def _engine(self, model: ModelRef) -> torch.nn.Module:
        """The module that generates for `model`: here the training module itself."""
        return self._live(model).model

    def sync_weights(self, model: ModelRef, route: Any = None) -> ModelRef:
        """Make the generation engine serve `model`. Here the engine reads the training module
        itself, so there is nothing to copy: only a stale version is refused."""
        self._live(model)
        return model

    # -- primitives --------------------------------------------------------------------------
    def generate(self, model: ModelRef, prompts: Prompts, *, n: int = 1, temperature: float = 1.0,
                 top_p: float = 1.0, max_new_tokens: int | None = None, stop: Sequence[str] = ()) -> Rollouts:
        home = prompts.ids.device
        params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens or self.max_new_tokens,
                                stop=stop)
        module = self._engine(model)
        decision = self.decode_decision(module, len(prompts) * n, prompts.ids.shape[1], params.max_new_tokens)
        engine = NativeGenerator(module, eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id,
                                 compile_decode=decision.compile, ledger=self.decode_ledger)
        with self._autocast():
            rollouts = engine.generate(to_device(prompts, self.device), n, params, seed=self.sampling.seed,
                                       call=self.sampling.advance(temperature))
        rollouts = self.cut_at_stop(rollouts, params.stop)
        # Static T: every rank's rollouts have the same shape, whatever its responses' lengths, so
        # shards concatenate and move between ranks without re-padding, and horizon-normalised
        # losses see the same T on one rank or many.
        return to_device(rollouts.pad_responses(params.max_new_tokens, pad_id=self.tokenizer.pad_token_id), home)

    def decode_decision(self, module: torch.nn.Module, rows: int, width: int, steps: int) -> Decision:
        """Whether generating `rows` rows from `width` prompt columns for `steps` tokens compiles the
        decode step (`decode_compile`; decided once per shape, so a run can print it at start)."""
        policy = self.decode_ledger.policy
        reason = lean_unsupported(module) if isinstance(module, torch.nn.Module) else "not a torch module"
        if reason is not None:
            if policy.mode == "on":
                raise ConfigError(f"generation.compile=on compiles the lean decode step, which cannot drive this model: "
                                  f"{reason}", fix="generation.compile: auto or off (one Hugging Face forward a token)")
            return Decision(False, f"the lean decode step cannot drive this model ({reason})")
        layers = module.config.num_hidden_layers
        return self.decode_ledger.decide(rows=rows, width=padded_width(width, policy.width), steps=steps, layers=layers,
                                         device=self.device.type, signature=model_signature(module))

    def rollout(self, model: ModelRef, env: EnvRef, prompts: Prompts, *, n: int = 1, temperature: float = 1.0,
                top_p: float = 1.0, max_turns: int = 4, max_tokens_per_turn: int | None = None,
                max_total_tokens: int | None = None, step_timeout: float | None = 30.0, env_workers: int | None = None,
                env_memory_mb: int = 4096) -> tuple[Rollouts, torch.Tensor, torch.Tensor]:
        """Multi-turn episodes of `env`'s environments, one per row, built from its recipe here or, with
        `env_workers=k` (the plan's), in k worker processes limited to `env_memory_mb` MiB each."""
        home = prompts.ids.device
        engine = self._engine(model)
        own = getattr(engine, "multi_turn_rollouts", None)  # an engine with its own multi-turn path (vLLM)
        if not isinstance(engine, torch.nn.Module) and own is None:
            raise NotImplementedError(f"rg.rollout runs on the native engine or vLLM; {model.role!r} generates with "
                                      f"{type(engine).__name__}, which has no multi-turn path: compile with "
                                      "engine='native'")
        total = max_total_tokens or self.max_new_tokens
        limits = TurnLimits(max_turns, max_tokens_per_turn or total, total, step_timeout)
        rows = len(prompts) * n
        envs = (self._worker_environments(env, rows, env_workers, env_memory_mb) if env_workers is not None
                else [self._environment(env) for _ in range(rows)])
        params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=limits.per_turn)
        if own is not None:
            outputs = own(to_device(prompts, torch.device("cpu")), envs, n=n, params=params, limits=limits,
                          seed=self.sampling.seed, call=self.sampling.advance(temperature), model=model,
                          decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
            return to_device(outputs, home)
        show = image_encoder(engine, self.tokenizer) if is_vision_lm(engine) else None  # image observations
        was_training = engine.training
        engine.eval()
        try:
            with torch.no_grad(), self._autocast():
                outputs = multi_turn_rollouts(
                    engine, to_device(prompts, self.device), envs, n=n, params=params, limits=limits,
                    seed=self.sampling.seed, call=self.sampling.advance(temperature), eos=self.tokenizer.eos_token_id,
                    pad=self.tokenizer.pad_token_id, decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                    show=show)
        finally:
            engine.train(was_training)
        return to_device(outputs, home)

    def _recipe(self, env: EnvRef) -> Callable[[], Any]:
        from rlgraph.agents.env import EnvError

        if env.role not in self.envs:
            raise EnvError(f"rg.rollout: no environment role {env.role!r} here; the executor has "
                           f"{', '.join(self.envs) or 'none'}",
                           fix="pass envs={'env': MyEnv} (a class or functools.partial building one) to the executor, "
                               "or an env: section to `rlgraph train`")
        return self.envs[env.role]

    def _worker_environments(self, env: EnvRef, rows: int, workers: int, memory_mb: int) -> list[Any]:
        """`rows` environments of role `env` in the role's worker processes (started on first use, kept)."""
        from rlgraph.agents.workers import EnvWorkers

        recipe = self._recipe(env)
        host = self.env_workers.get(env.role)
        if host is None or (host.recipe, host.workers, host.memory_mb) != (recipe, workers, memory_mb):
            if host is not None:
                host.close()
            host = self.env_workers[env.role] = EnvWorkers(recipe, workers, memory_mb=memory_mb)
        return host.environments(rows, self.tokenizer)

    def _environment(self, env: EnvRef) -> Any:
        """A fresh environment of role `env`, speaking the token protocol (`rlgraph.agents.as_token_env`)."""
        from rlgraph.agents.env import as_token_env, build_env, observation_format

        built = build_env(self._recipe(env), f"environment role {env.role!r}")
        return as_token_env(built, self.tokenizer, observation_format(built, self.tokenizer))

    def cut_at_stop(self, rollouts: Rollouts, stop: Sequence[str]) -> Rollouts:
        """Each response ended after its first stop string, read as the rewards read it (`decode_responses`)."""
        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

        return cut_at_stop(rollouts, stop, decode, self.tokenizer.pad_token_id)

    def logprobs(self, model: ModelRef, rollouts: Rollouts, *, temperature: float = 1.0, entropy: bool = False,
                 vocab: bool = False, micro_batch_tokens: int | None = None) -> Any:
        worker = self._live(model)
        _check_ids(worker, rollouts, f"rg.logprobs({model.role})")
        output, ent = self._inference(worker, rollouts, temperature=temperature, with_entropy=entropy,
                                      budget=micro_batch_tokens, where=f"rg.logprobs({model.role})", vocab=vocab)
        return (output, ent) if entropy else output  # on the rollouts' device (`_inference`)

    def values(self, model: ModelRef, rollouts: Rollouts, *, micro_batch_tokens: int | None = None) -> torch.Tensor:
        worker = self._live(model)
        if worker.kind != "critic":
            raise ValueError(f"role {model.role!r} is a {worker.kind} model; values need a critic (LMWorker(kind='critic'))")
        _check_ids(worker, rollouts, f"rg.values({model.role})")
        return self._inference(worker, rollouts, temperature=1.0, with_entropy=False, budget=micro_batch_tokens,
                               where=f"rg.values({model.role})")[0]

    def _inference(self, worker: LMWorker, rollouts: Rollouts, *, temperature: float, with_entropy: bool,
                   budget: int | None = None, where: str = "", vocab: bool = False):
        """`_forward` in eval mode without gradients (reference and old log-probs, critic values),
        run on the executor's device; the outputs come back on the rollouts' device. `budget`:
        packed forwards of at most that many tokens each (`packing.pack_rows`); None: one padded forward."""
        was_training = worker.model.training and not self._inference_only(worker)
        set_mode(worker.model, training=False)
        batch = to_device(rollouts, self.device)
        try:
            with torch.no_grad(), self._autocast():
                if vocab:  # [N, T, V]: eager, padded (the packed and compiled forwards give token log-probs)
                    _refuse_packed_vocab(budget, where)
                    outputs = self._forward(worker, batch, temperature=temperature, with_entropy=False, vocab=True)
                elif budget is None:
                    outputs = self._compiled_forward(worker, batch, temperature=temperature, with_entropy=with_entropy)
                else:
                    outputs = self._packed_inference(worker, batch, temperature, with_entropy, budget, where)
        finally:
            set_mode(worker.model, training=was_training)
        return to_device(outputs, rollouts.response_ids.device)

    def _inference_only(self, worker: LMWorker) -> bool:
        """Whether `worker` is a frozen role that shares no module with a trainable one (a reference
        model, not a LoRA policy's reference view): only inference runs it, so `_inference` leaves
        it in eval mode instead of walking its modules back to train mode every call."""
        key = self._role_of(worker)
        if key not in self._inference_only_roles:
            trained = {id(module) for held in self.models.values() if held.optimizer is not None
                       for module in held.model.modules()}
            self._inference_only_roles[key] = worker.optimizer is None and not any(
                id(module) in trained for module in worker.model.modules())
        return self._inference_only_roles[key]

    def _packed_inference(self, worker: LMWorker, batch: Rollouts, temperature: float, with_entropy: bool,
                          budget: int, where: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The outputs [N, T] (and entropy) of `batch` from packed forwards of <= `budget` tokens each."""
        output = torch.zeros(batch.mask.shape, device=self.device)  # [N, T]
        entropy = torch.zeros(batch.mask.shape, device=self.device) if with_entropy else None  # [N, T]
        micros, real = self._micro_batches(worker, batch, torch.arange(len(batch)), budget, where)
        for micro in micros[:real]:
            rows = micro.to(self.device)
            part, part_entropy = self._compiled_forward(worker, batch.select(micro), temperature=temperature,
                                                        with_entropy=with_entropy, packed=True)
            output[rows] = part.float()
            if entropy is not None:
                entropy[rows] = part_entropy.float()
        for micro in micros[real:]:  # fillers: forwards that only keep this rank's collectives in step
            self._compiled_forward(worker, batch.select(micro), temperature=temperature, with_entropy=with_entropy,
                                   packed=True)
        return output, entropy

    def _micro_batches(self, worker: LMWorker, batch: Rollouts, rows: torch.Tensor, budget: int | None,
                       where: str, size: int | None = None) -> tuple[list[torch.Tensor], int]:
        """(`rows` in micro-batches, how many of them are real): of at most `budget` real tokens
        (packed), else of `size` rows.

        Every data-parallel rank of the role runs as many packed micro-batches as the rank that
        needs most (their forwards are collectives under FSDP2): a rank with fewer splits its
        widest micro-batches, and when it has fewer rows than that it adds fillers (its first row
        again) after the real ones, whose forwards and backwards count nothing."""
        if budget is None:
            micros = split_rows(rows, size=size or len(rows))
            return micros, len(micros)
        micros = pack_rows(rows, row_tokens(batch).cpu(), budget, where)
        wanted = self._all_reduce_max(self._role_of(worker), len(micros))
        while len(micros) < wanted and max(map(len, micros), default=0) > 1:
            widest = max(range(len(micros)), key=lambda i: len(micros[i]))
            micros[widest:widest + 1] = list(torch.tensor_split(micros[widest], 2))
        return micros + [rows[:1]] * (wanted - len(micros)), len(micros)

    def _compiled_forward(self, worker: LMWorker, rollouts: Rollouts, *, temperature: float, with_entropy: bool,
                          packed: bool = False, vocab: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_forward` of an update's micro-batch, or of an inference forward (reference and old
        log-probs, values): compiled with `compile_train` (`train_compile.py`); `vocab` runs eager."""
        if vocab:
            _refuse_packed_vocab(packed, "rg.update(vocab=True)")
            return self._forward(worker, rollouts, temperature=temperature, with_entropy=False, vocab=True)
        if not self.compile_train:
            return self._forward(worker, rollouts, temperature=temperature, with_entropy=with_entropy, packed=packed)
        from rlgraph.backends.local.train_compile import compiled_role_outputs, mark_dynamic_shapes

        # The LM head inside the compiled graph where its logits fit one block (`head_fits_one_block`)
        dense = not packed and worker.kind == "lm" and head_fits_one_block(worker.model, *rollouts.mask.shape)
        compiled = compiled_role_outputs(self.device.type)
        return compiled(worker.model, worker.kind, mark_dynamic_shapes(rollouts), temperature=temperature,
                        with_entropy=with_entropy, packed=packed, dense_head=dense)

    def _forward(self, worker: LMWorker, rollouts: Rollouts, *, temperature: float, with_entropy: bool,
                 packed: bool = False, vocab: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs or values [n, T], entropy [n, T] or None) of `rollouts`, with gradients;
        `packed`: one forward over the rows' real tokens, without padding (`packing`); `vocab`: the
        log-softmax over the vocabulary [n, T, V] instead of the log-probs."""
        return role_outputs(worker.model, worker.kind, rollouts, temperature=temperature, with_entropy=with_entropy,
                            packed=packed, vocab=vocab)

    def score(self, reward: RewardRef, rollouts: Rollouts) -> torch.Tensor:
        if reward.role not in self.rewards:
            raise KeyError(f"the local executor has no reward role {reward.role!r}; it has {', '.join(self.rewards)}")
        completions = decode_responses(self.tokenizer, rollouts)
        values = self.rewards[reward.role].fn(completions, **rollouts.meta)
        scores = _as_scores(reward.role, values, completions)
        # Decoding and a Python reward run on the host; the scores join the rollouts' device.
        return scores.to(rollouts.response_ids.device)

    def update(self, model: ModelRef, batch: Rollouts, loss_fn: LossFn, config: UpdateConfig) -> tuple[ModelRef, dict[str, float]]:
        worker = self._live(model)
        if worker.optimizer is None:
            raise ValueError(f"role {model.role!r} is frozen (no optimizer); only trainable roles can be updated")
        _check_ids(worker, batch, f"rg.update({model.role})")
        # `loss_fn` must hold its captured values on this device too (the interpreter moves them).
        kept = torch.zeros(batch.mask.shape, device=self.device) if config.outputs else None  # [N, T]
        stats = self._train_epochs(worker, to_device(batch, self.device), loss_fn, config, kept)
        worker.version += 1
        if kept is not None:
            return ModelRef(model.role, worker.version), kept.to(batch.mask.device), stats
        return ModelRef(model.role, worker.version), stats

    def optimizer_step(self, model: ModelRef, *, lr: float | None = None, betas: tuple[float, float] | None = None,
                       eps: float | None = None, weight_decay: float | None = None, grad_clip: float | None = None
                       ) -> tuple[ModelRef, dict[str, float]]:
        """Apply the gradients the role holds (`update(step=False)` accumulated them), then clear them."""
        worker = self._live(model)
        if worker.optimizer is None:
            raise ValueError(f"role {model.role!r} is frozen (no optimizer); only trainable roles can step")
        given = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        for group in worker.optimizer.param_groups:
            group.update({key: value for key, value in given.items() if value is not None})
        grad_norm = self._clip_grads(worker, grad_clip if grad_clip is not None else float("inf"))
        if not math.isfinite(grad_norm):
            worker.optimizer.zero_grad(set_to_none=True)  # nothing non-finite reaches the weights
            raise NonFiniteUpdate(f"optimizer_step of {model}: the accumulated gradient norm is {grad_norm}; the "
                                  "gradients were dropped and no weight changed")
        worker.optimizer.step()
        worker.optimizer.zero_grad(set_to_none=True)
        worker.version += 1
        return ModelRef(model.role, worker.version), {"grad_norm": grad_norm}

    # -- checkpoints -----------------------------------------------------------------------------
    def export_state(self) -> ExecutorState:
        # On the CPU, whatever the device, so a checkpoint loads on any machine.
        roles = {role: RoleState({k: v.detach().cpu().contiguous() for k, v in checkpoint_weights(worker).items()},
                                 None if worker.optimizer is None else to_device(worker.optimizer.state_dict(), "cpu"),
                                 optimizer_kind(worker.optimizer), worker.version)
                 for role, worker in self.models.items()}
        return ExecutorState(roles, self.generator.get_state(), attrs.asdict(self.sampling))

    def import_state(self, state: ExecutorState, where: str = "the checkpoint") -> None:
        """Restore `state`, all or nothing: every role, shape and optimizer kind is checked first."""
        for role, worker in self.models.items():
            check_role_state(role, checkpoint_weights(worker), optimizer_kind(worker.optimizer), state, where)
        for role, worker in self.models.items():
            held = state.roles[role]
            load_checkpoint_weights(worker, held.model)
            if worker.optimizer is not None:
                worker.optimizer.load_state_dict(dict(held.optimizer))
            worker.version = held.version
        self.generator.set_state(state.shuffle_rng)
        self.sampling = SamplingStream(**state.sampling)

    def _role_of(self, worker: LMWorker) -> str:
        return next(role for role, held in self.models.items() if held is worker)


def require_device(device: torch.device | str) -> torch.device:
    """`device` as a `torch.device`; a CUDA device on a machine without a GPU is refused with the fix."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was asked for, but torch sees no CUDA GPU here; use 'cpu' "
                         "(or 'auto' where offered: it picks cuda only when a GPU is present)")
    return device


def _as_scores(role: str, values: Any, completions: list[str]) -> torch.Tensor:
    """A reward function's result as f32[N], or a `RewardError` naming the first bad sample."""
    fn = f"reward function {role!r}"
    try:
        scores = torch.as_tensor(values, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        bad = next((i for i, v in enumerate(values) if not isinstance(v, (int, float, bool))), 0) \
            if isinstance(values, (list, tuple)) else None
        where = f"; sample {bad} got {values[bad]!r} for completion {completions[bad]!r}" if bad is not None else ""
        raise RewardError(f"{fn} returned {type(values).__name__} that is not a list of numbers{where}\n  fix: return "
                          "one float per completion, in order") from None
    if scores.shape != (len(completions),):
        raise RewardError(f"{fn} returned shape {tuple(scores.shape)}; expected one number per completion "
                          f"({len(completions)},)")
    bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
    if bad:
        shown = ", ".join(f"sample {i}: {scores[i].item()} for {completions[i]!r}" for i in bad[:3])
        raise RewardError(f"{fn} returned non-finite rewards for {len(bad)} sample(s) ({shown}); nothing was trained "
                          "on them\n  fix: return a finite number for every completion (e.g. 0.0 for a failure)")
    return scores


def _refuse_packed_vocab(packed: Any, where: str) -> None:
    if packed:  # the pack pass sets a token budget on every update and logprobs of a packed compile
        raise ValueError(f"{where}: the vocabulary's log-probs [N, T, V] run on padded rows; compiled with "
                         "micro_batch_tokens they would be packed: compile without micro_batch_tokens")


def decode_responses(tokenizer: Any, rollouts: Rollouts) -> list[str]:
    ids = rollouts.response_ids.masked_fill(~rollouts.mask, tokenizer.pad_token_id)  # [N, T]
    return tokenizer.batch_decode(ids.tolist(), skip_special_tokens=True)
