"""Our SDPO and replay channels inside a TRL run: ``ChannelGRPOTrainer`` is a ``trl.GRPOTrainer``.

    from prime_composer.integrations.trl import ChannelGRPOTrainer, TRLChannels

    channels = TRLChannels(
        loss=LossConfig(sdpo={"weight": 0.1}, replay={"weight": 0.05}),  # our trainer.loss sections
        hints=HintConfig(enabled=True, sources=["sibling"]),             # our orchestrator.sdpo section
        pairs=PairSource(ReplaySourceConfig(store=...), output_dir),     # any async take(step) -> pairs
        seq_len=1024,
    )
    trainer = ChannelGRPOTrainer(model, reward_funcs, args=GRPOConfig(loss_type="dapo", ...),
                                 train_dataset=..., processing_class=tokenizer, channels=channels)
    trainer.train()

The loss of a micro-batch is TRL's own GRPO loss plus ``sum_k weight_k * L_k`` over our enabled
channel terms (``trainer.loss.sdpo``, ``trainer.loss.replay``), each the project's own
``LossTerm`` (``trainer/losses/sdpo_term.py``, ``replay_term.py``) run through the same protocol
as ``trainer/step.py``; the math is not written again here. Per generation and per step:

1. After TRL scored its completions (``_generate_and_score_completions``), every row becomes a
   ``Sample`` (its unpadded prompt and completion tokens, the weighted reward TRL computed, its
   group of ``num_generations``, the conversation with the decoded reply), and the project's
   ``HintBuilder`` (``orchestrator/sdpo/hints.py``) sets SDPO targets on the failed ones. The
   pair source's pairs for the step are dealt round-robin over the rows. Both travel in TRL's
   batch dict as per-row lists (``channel_samples``, ``channel_pairs``), so TRL's shuffle and
   split keep them with their rows.
2. At the first micro-batch of an optimizer step the window's hinted samples and pairs are packed
   by ``orchestrator/packing.py`` with ``SDPOPacker`` and ``ReplayPacker``, one ``MicroBatch``
   per micro-batch, and every term's ``begin_step`` sees the whole window: the normalizers (SDPO
   target tokens, trained pairs) are global over the optimizer step, as in our trainer.
3. Per micro-batch: the terms' no-grad ``prepare`` (SDPO teacher, refreshed DPO reference), one
   ``forward_micro_batch`` of the hinted samples only (SDPO's student logits; skipped when the
   micro-batch has none), ``term.loss``, the weighted sum; added to TRL's loss.
4. After every optimizer step a callback moves the EMA teacher and the refreshed reference
   (``TermContext.after_optimizer_step``).

A term with weight 0 is never built (``build_terms``): no policy copy, no teacher forward, no
packing of its data, no hint building. TRL's GRPO part is TRL's: with ``loss_type = "dapo"`` and
no reference KL it is our ``rl`` term with ``aggregation = "token_mean"`` (``tests/unit/
test_trl_channels.py`` checks the loss and gradients of the sum against ``train_step``).

What TRL's trainer cannot host, so this class does not offer it (``README`` and
``docs/architecture.md`` say so too): replay pairs arriving asynchronously between generations
(a pair source is asked once per generation batch, on the trainer's own process, and blocks it),
off-policy batches from an inference fleet (TRL generates its own, ``max_off_policy_steps`` has no
counterpart), FSDP2 copies of the teacher (``PolicyCopy`` deep-copies the policy on each process;
the multi-process path is untested), tool-calling rollouts (``tool_mask``: the hint builder's
render check needs the conversation TRL does not keep), and SDPO hints on plain-text prompts
(the hinted teacher context is rendered with the chat template).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

try:
    from transformers import TrainerCallback
    from trl import GRPOTrainer
except ImportError as e:  # pragma: no cover - trl is a dev dependency
    raise ImportError(
        "prime_composer.integrations.trl needs trl (tested with trl==1.16.0): install it with "
        "`uv sync --group dev` or `pip install trl==1.16.0`"
    ) from e

from prime_composer.config.loss import LossConfig
from prime_composer.config.sdpo import HintConfig
from prime_composer.orchestrator.packing import GroupPacker, pack_step
from prime_composer.orchestrator.record import EpisodeRecord
from prime_composer.orchestrator.replay.packing import ReplayPacker
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.sdpo.hints import HintBuilder
from prime_composer.orchestrator.sdpo.packing import SDPOPacker
from prime_composer.orchestrator.sdpo.target import sdpo_target
from prime_composer.trainer.forward import ForwardOutput, forward_micro_batch
from prime_composer.trainer.losses.aggregate import accumulate_metrics, finalize_metrics
from prime_composer.trainer.losses.base import LossTerm, TermContext, build_terms
from prime_composer.transport.batch import MicroBatch
from prime_composer.transport.groups import SDPOGroup

SAMPLES_KEY = "channel_samples"
"""Batch-dict key of the per-row ``Sample`` (with its SDPO target, if any)."""
PAIRS_KEY = "channel_pairs"
"""Batch-dict key of the per-row list of replay pairs dealt to that row."""


class PairSourceLike(Protocol):
    """What gives replay pairs: ``orchestrator/replay/source.PairSource`` or any object with this
    method (``Pair`` or ``HeldOutPair`` items, ``teacher/pairs.py``)."""

    async def take(self, step: int) -> list[Any]: ...


@dataclass
class TRLChannels:
    """Which of our channels a ``ChannelGRPOTrainer`` adds, with the project's own config sections."""

    loss: LossConfig = field(default_factory=LossConfig)
    """``trainer.loss``: only ``sdpo`` and ``replay`` are read (their ``weight`` is alpha / beta);
    the RL part is TRL's own loss (``GRPOConfig.loss_type``), so ``loss.rl`` is ignored."""
    hints: HintConfig | None = None
    """``orchestrator.sdpo``: how failed rollouts get hints; needed when ``loss.sdpo.weight > 0``."""
    pairs: PairSourceLike | None = None
    """Where replay pairs come from; needed when ``loss.replay.weight > 0``."""
    seq_len: int = 2048
    """Row length of the packed channel micro-batches and the longest hinted teacher context."""
    feedback_column: str = "feedback"
    """Dataset column whose value becomes the episode's environment feedback (for the
    ``feedback`` hint source), when the dataset has it."""


def _unpatched_copy(model: nn.Module) -> nn.Module:
    """A deep copy of the policy without TRL's fused-head ``forward``: TRL sets ``model.forward``
    to a closure over the *original* model's forward, so a plain deepcopy would still run the
    policy's weights."""
    clone = copy.deepcopy(model)
    if "forward" in vars(clone):
        del clone.forward
    return clone


class _AfterOptimizerStep(TrainerCallback):  # type: ignore[misc]
    def __init__(self, ctx: TermContext) -> None:
        self.ctx = ctx

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ctx.after_optimizer_step()


class ChannelGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
    """``trl.GRPOTrainer`` plus our SDPO and replay loss terms (see the module docstring)."""

    def __init__(self, *args: Any, channels: TRLChannels | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.channels = channels or TRLChannels()
        cfg = self.channels.loss
        if cfg.rl.weight != 1.0 or cfg.rl.kl_coef != 0.0:
            raise ValueError(
                "TRLChannels.loss.rl is not used: the RL part is TRL's GRPO loss (set GRPOConfig.loss_type, "
                "beta); leave loss.rl at its defaults"
            )
        if self._args.steps_per_generation % self._args.gradient_accumulation_steps:
            raise ValueError(
                f"GRPOConfig.steps_per_generation ({self._args.steps_per_generation}) must be a multiple of "
                f"gradient_accumulation_steps ({self._args.gradient_accumulation_steps}): the channels' "
                "normalizers span one optimizer step's micro-batches"
            )
        policy = self.accelerator.unwrap_model(self.model)
        self.term_context = TermContext(policy, make_copy=lambda: _unpatched_copy(policy))
        # The RL term is TRL's: build ours from a copy of the config without it.
        ours = cfg.model_copy(update={"rl": cfg.rl.model_copy(update={"weight": 0.0})})
        self.channel_terms: list[LossTerm] = build_terms(ours, self.term_context)
        names = {t.name for t in self.channel_terms}
        unknown = names - {"sdpo", "replay"}
        if unknown:
            raise ValueError(
                f"TRLChannels.loss enables {sorted(unknown)}, which ChannelGRPOTrainer cannot run"
            )
        self.hints: HintBuilder | None = None
        if "sdpo" in names:
            if self.channels.hints is None:
                raise ValueError(
                    "TRLChannels.loss.sdpo.weight > 0 needs TRLChannels.hints (the orchestrator.sdpo section) "
                    "to hint failed rollouts; set it, or set the weight to 0"
                )
            self.hints = HintBuilder(self.channels.hints, self.processing_class, self.channels.seq_len)
        if "replay" in names and self.channels.pairs is None:
            raise ValueError(
                "TRLChannels.loss.replay.weight > 0 needs TRLChannels.pairs (a pair source such as "
                "orchestrator.replay.source.PairSource); set it, or set the weight to 0"
            )
        self.add_callback(_AfterOptimizerStep(self.term_context))
        self._loop = asyncio.new_event_loop()
        self._rewards: Tensor | None = None
        self._window: list[MicroBatch] = []
        self._window_loss: dict[str, float] = {}
        self._window_metrics: dict[str, Tensor] = {}

    @property
    def _args(self) -> Any:
        """``self.args``, a ``GRPOConfig`` (typed as the ``TrainingArguments`` it extends)."""
        return self.args

    @property
    def _training(self) -> bool:
        return bool(getattr(self.model, "training", False))

    @property
    def _pad_token_id(self) -> int:
        return int(getattr(self.processing_class, "pad_token_id", 0) or 0)

    # ------------------------------------------------------------------------ generation side

    def _calculate_rewards(
        self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any
    ) -> Tensor:
        rewards_per_func: Tensor = super()._calculate_rewards(
            inputs, prompts, completions, completion_ids_list
        )
        # TRL's own weighted sum (as in _generate_and_score_completions), over every process's rows.
        weights = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        self._rewards = (rewards_per_func * weights).nansum(dim=1)
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        output: dict[str, Any] = super()._generate_and_score_completions(inputs)
        if not self.channel_terms:
            return output
        if "tool_mask" in output:
            raise ValueError("ChannelGRPOTrainer does not support tool-calling rollouts (tool_mask) yet")
        num_rows = output["completion_ids"].shape[0]
        first = self.accelerator.process_index * num_rows
        rewards = self._rewards
        local = rewards[first : first + num_rows] if rewards is not None else torch.zeros(num_rows)
        samples = samples_from_rows(
            output, inputs, local.tolist(), self.processing_class, int(self.num_generations or 1), first,
            self.channels.feedback_column,
        )  # fmt: skip
        if self.hints is not None:
            stats = self._loop.run_until_complete(self.hints.apply(samples))
            mode = "train" if self._training else "eval"
            for key, value in stats.metrics(
                self.channels.hints.sources if self.channels.hints else []
            ).items():
                self._metrics[mode][key].append(float(value))
        output[SAMPLES_KEY] = samples
        pairs: list[Any] = []
        if self.channels.pairs is not None and any(t.name == "replay" for t in self.channel_terms):
            pairs = self._loop.run_until_complete(self.channels.pairs.take(int(self.state.global_step)))
        output[PAIRS_KEY] = deal(pairs, num_rows)
        return output

    # ----------------------------------------------------------------------------- loss side

    def _window_inputs(self, inputs: dict[str, Any]) -> list[dict[str, Any]]:
        """The batch dicts of the optimizer step ``inputs`` belongs to (TRL's buffered split)."""
        buffered = getattr(self, "_buffered_inputs", None)
        if not self._training or not buffered:
            return [inputs]
        accumulation = self._accumulation()
        start = (self._step % self._args.steps_per_generation) // accumulation * accumulation
        return list(buffered[start : start + accumulation])

    def _accumulation(self) -> int:
        """Micro-batches per optimizer step (Trainer sets the attribute in its loop)."""
        return int(
            getattr(self, "current_gradient_accumulation_steps", self._args.gradient_accumulation_steps)
        )

    def begin_window(self, window: Sequence[dict[str, Any]]) -> None:
        """Pack the window's channel data and compute every term's normalizers over it."""
        self._window = [self.channel_batch(inputs) for inputs in window]
        for term in self.channel_terms:
            term.begin_step(self._window)
        self._window_loss = {t.name: 0.0 for t in self.channel_terms}
        self._window_metrics = {}

    def channel_batch(self, inputs: dict[str, Any]) -> MicroBatch:
        """One ``MicroBatch`` of a TRL micro-batch's hinted samples (core rows) and pairs (the
        replay group), packed by the project's packers."""
        names = {t.name for t in self.channel_terms}
        samples = (
            [s for s in inputs.get(SAMPLES_KEY, []) if sdpo_target(s) is not None] if "sdpo" in names else []
        )
        packers: list[GroupPacker] = [SDPOPacker()] if "sdpo" in names else []
        extras: dict[str, list[Any]] = {}
        if "replay" in names:
            packers.append(ReplayPacker())
            extras["replay"] = [p for row in inputs.get(PAIRS_KEY, []) for p in row]
        rank_batches, _ = pack_step(
            samples, self.channels.seq_len, max(1, len(samples)), 1,
            pad_token_id=self._pad_token_id, temperature=float(self.temperature),
            packers=packers, extras=extras,
        )  # fmt: skip
        (mb,) = rank_batches[0]  # one micro-batch: at most one row per sample
        return mb

    def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> Tensor:
        loss: Tensor = super()._compute_loss(model, inputs)
        if not self.channel_terms:
            return loss
        accumulation = self._accumulation() if self._training else 1
        index = self._step % accumulation if self._training else 0
        if index == 0 or not self._window:
            self.begin_window(self._window_inputs(inputs))
        extra = self.channel_loss(index)
        if index == len(self._window) - 1:
            self._log_window()
        # Our normalizers are global over processes; data parallelism averages gradients.
        return loss + extra.to(loss.device, loss.dtype) * self.accelerator.num_processes

    def channel_loss(self, index: int) -> Tensor:
        """``sum_k weight_k * L_k`` of micro-batch ``index`` of the window, as ``train_step``'s
        inner loop computes it (prepare, one student forward, the terms' losses)."""
        policy = self.term_context.policy
        mb = self._window[index].to(next(policy.parameters()).device)
        for term in self.channel_terms:
            term.prepare(index, mb)
        masks = {t.name: m for t in self.channel_terms if (m := t.logits_mask(mb)) is not None}
        if mb.group(SDPOGroup) is not None:
            out = forward_micro_batch(policy, mb, logits_masks=masks)
        else:  # no hinted sample here: the student forward would score nothing
            zeros = torch.zeros(mb.input_ids.shape, dtype=torch.float32, device=mb.input_ids.device)
            out = ForwardOutput(logprobs=zeros, entropy=zeros)
        total = torch.zeros((), dtype=torch.float32, device=mb.input_ids.device)
        for term in self.channel_terms:
            part, metrics = term.loss(index, mb, out)
            total = total + term.weight * part
            self._window_loss[term.name] += float(part.detach())
            self._window_metrics = accumulate_metrics(self._window_metrics, metrics)
        return total

    def _log_window(self) -> None:
        mode = "train" if self._training else "eval"
        logged = finalize_metrics(self._window_metrics)
        for term in self.channel_terms:
            logged[f"loss/{term.name}"] = self._window_loss[term.name]
            logged.update(term.step_metrics())
        for key, value in logged.items():
            self._metrics[mode][key].append(float(value))


def deal(items: Sequence[Any], num_rows: int) -> list[list[Any]]:
    """``items`` dealt round-robin to ``num_rows`` rows (a row's list may be empty)."""
    rows: list[list[Any]] = [[] for _ in range(num_rows)]
    for i, item in enumerate(items):
        rows[i % num_rows].append(item)
    return rows


def samples_from_rows(
    output: dict[str, Any],
    inputs: Sequence[dict[str, Any]],
    rewards: Sequence[float],
    tokenizer: Any,
    num_generations: int,
    first_row: int = 0,
    feedback_column: str = "feedback",
) -> list[Sample]:
    """One ``Sample`` per row of TRL's scored batch: the prompt without its left padding, the
    completion up to its mask's end, the reward, the group (``num_generations`` consecutive rows
    over every process; ``first_row`` is this process's first), and for a conversational prompt
    the conversation with the decoded reply (what the hint builder renders)."""
    samples = []
    for i, example in enumerate(inputs):
        prompt = output["prompt_ids"][i][output["prompt_mask"][i].bool()].tolist()
        num_completion = int(output["completion_mask"][i].sum())
        completion = output["completion_ids"][i][:num_completion].tolist()
        messages: list[dict[str, Any]] = []
        if isinstance(example.get("prompt"), list):
            reply = tokenizer.decode(completion, skip_special_tokens=True)
            messages = [*example["prompt"], {"role": "assistant", "content": reply}]
        group = (first_row + i) // num_generations
        samples.append(
            Sample(
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=[0.0] * num_completion,
                completion_mask=[1] * num_completion,
                reward=float(rewards[i]),
                example_id=group,
                group_id=group,
                policy_step=0,
                episode=EpisodeRecord(messages=messages, feedback=example.get(feedback_column)),
            )
        )
    return samples
