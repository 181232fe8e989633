"""Replaying traces: plan each trace with the gate, label the chosen steps, fill in pairs.

For each trace not yet done (``TeacherStore.pending_traces``):

1. **Plan** (once; the plan is stored, so a restart asks the same steps): the gate's features and
   score for every step, its expected cost (the cascade's first teacher, plus the others with the
   escalation probability), and which steps are selected.
2. **Label** each selected step, ``max_concurrent_steps`` at a time across traces: show the
   teachers the state (``prompts.teacher_messages``) — with the cascade, the cheapest first and the
   others only if it disagrees with the trace, gives no action, or the student was uncertain —
   then turn the votes into a label (``votes.label_step``) and, for a pair, a pair candidate (with
   an on-policy chosen side when configured). The label, votes, cost and candidate are one
   transaction.
3. **Reference** (``reference_pass``, in a worker thread): tokenize pending candidates and compute
   their reference logprobs in batches; each becomes ready with the next cursor.

Everything a teacher call does to money goes through ``TeacherPool.ask`` (cache, budget, ledger).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from prime_composer.config.teacher import TeacherEndpointConfig, TeacherServiceConfig
from prime_composer.teacher.actions import Action, render_action, turn_action
from prime_composer.teacher.gate import select_steps, step_features
from prime_composer.teacher.pool import Answer, StudentSampler, TeacherPool
from prime_composer.teacher.prompts import agent_messages, student_messages, teacher_messages
from prime_composer.teacher.reference import ReferenceScorer
from prime_composer.teacher.store import PairCandidate, PlannedStep, TeacherStore
from prime_composer.teacher.traces import Trace, read_trace_file, read_verifiers_file
from prime_composer.teacher.voi import DisagreementModel, label_of
from prime_composer.teacher.votes import StepLabel, Vote, label_step

logger = logging.getLogger(__name__)


@dataclass
class ImportSummary:
    num_added: int = 0
    num_rejected: int = 0


def import_sources(cfg: TeacherServiceConfig, store: TeacherStore) -> ImportSummary:
    """Import the configured trace files; every rejected line is logged and kept in the store."""
    summary = ImportSummary()
    sources = [(p, read_trace_file) for p in cfg.traces.files] + [
        (p, read_verifiers_file) for p in cfg.traces.verifiers_files
    ]
    for path, reader in sources:
        if not path.exists():
            raise ValueError(
                f"teacher.traces: {path} does not exist (check traces.files / traces.verifiers_files)"
            )
        result = reader(path, cfg.traces)
        for number, message in result.errors:
            logger.warning("rejected trace: %s", message)
            store.record_import_error(str(path), number, message)
        for number, trace in result.traces:
            conflict = store.add_trace(trace)
            if conflict is not None:
                logger.warning("rejected trace: %s", conflict)
                store.record_import_error(str(path), number, conflict)
                summary.num_rejected += 1
            else:
                summary.num_added += 1
        summary.num_rejected += len(result.errors)
        logger.info("%s: %d traces, %d lines rejected", path, len(result.traces), len(result.errors))
    return summary


class Replayer:
    """Plans and labels the store's pending traces (one event loop; the store is not shared)."""

    def __init__(
        self,
        cfg: TeacherServiceConfig,
        store: TeacherStore,
        pool: TeacherPool,
        student: StudentSampler | None = None,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.pool = pool
        self.student = student
        self.voi: DisagreementModel | None = None
        """The calibrated gate's model (``gate.model = "calibrated"``), refit from the stored labels."""
        if cfg.gate.model == "calibrated":
            self.voi = DisagreementModel(cfg.gate.learning_rate).fit(store.gate_examples())
        self.stopping = threading.Event()
        """Set (from any thread) to stop starting steps: ``run_pending`` returns once the steps in
        flight are labeled, and the traces it did not finish stay pending for the next pass."""

    # ------------------------------------------------------------------------------------ plan

    def plan(self, trace: Trace) -> list[PlannedStep]:
        """The stored plan of ``trace``, made and stored now if there is none."""
        stored = self.store.plan(trace.trace_id)
        if stored is not None:
            return stored
        gate = self.cfg.gate
        features = step_features(trace, gate, self.store.step_evaluated)
        costs = [self._expected_cost(trace, f.turn_index, f.uncertainty) for f in features]
        views = [f.as_dict() | {"prior": f.score(gate)} for f in features]
        voi = self.voi
        scores = [v["prior"] if voi is None else voi.predict(v, v["prior"]) for v in views]
        selected = set(select_steps(features, costs, gate, scores))
        plan = [
            PlannedStep(f.turn_index, f.state_hash, view, score, cost, f.turn_index in selected, f.action_key)
            for f, view, score, cost in zip(features, views, scores, costs, strict=True)
        ]
        self.store.save_plan(trace.trace_id, plan)
        return plan

    def _expected_cost(self, trace: Trace, turn_index: int, uncertainty: float) -> float:
        messages = teacher_messages(trace, turn_index, self.cfg.instructions)
        order = self.pool.cascade_order(messages)
        costs = [self.pool.expected_cost(e, messages) for e in order]
        gate = self.cfg.gate
        if not gate.cascade:
            return sum(costs)
        escalation = 1.0 if uncertainty >= gate.escalate_uncertainty else gate.escalation_prior
        return costs[0] + escalation * sum(costs[1:])

    # ----------------------------------------------------------------------------------- label

    async def run_pending(self) -> int:
        """Plan and label every pending step of every pending trace; returns the steps labeled."""
        semaphore = asyncio.Semaphore(self.cfg.max_concurrent_steps)
        touched: list[str] = []
        num_labeled = 0

        async def label_released(trace: Trace, planned: PlannedStep) -> None:
            nonlocal num_labeled
            try:
                await self.label(trace, planned)
                num_labeled += 1
            finally:
                semaphore.release()

        if self.cfg.pairs.step_dpo:
            return await self._run_first_errors(semaphore)
        async with asyncio.TaskGroup() as group:
            for trace_id in self.store.pending_traces():
                if self.stopping.is_set():
                    break
                trace = self.store.load_trace(trace_id)
                plan = {p.turn_index: p for p in self.plan(trace)}
                complete = True
                for turn_index in self.store.pending_steps(trace_id):
                    await semaphore.acquire()
                    if self.stopping.is_set():
                        semaphore.release()
                        complete = False
                        break
                    group.create_task(label_released(trace, plan[turn_index]))
                if complete:
                    touched.append(trace_id)
        for trace_id in touched:
            self.store.mark_trace_done(trace_id)
        return num_labeled

    async def _run_first_errors(self, semaphore: asyncio.Semaphore) -> int:
        """Step-DPO (``pairs.step_dpo``): each trace's selected steps in turn order, one at a time,
        up to the first the teachers judge wrong (a pair): its context is the trace's prefix, which
        no labeled step before it found wrong. The later steps are not asked (their contexts hold
        the error) and are stored as skipped (outcome ``after_error``); so is the rest of a trace
        after a step the budget refused (its correctness unknown)."""
        touched: list[str] = []
        num_labeled = 0

        async def first_error(trace: Trace, plan: dict[int, PlannedStep], steps: list[int]) -> None:
            nonlocal num_labeled
            try:
                for i, turn_index in enumerate(steps):
                    if self.stopping.is_set():
                        return
                    label = await self.label(trace, plan[turn_index])
                    num_labeled += 1
                    if label is None or label.outcome == "pair":
                        for later in steps[i + 1 :]:
                            self._finish_skipped(trace, later)
                        break
                touched.append(trace.trace_id)
            finally:
                semaphore.release()

        async with asyncio.TaskGroup() as group:
            for trace_id in self.store.pending_traces():
                await semaphore.acquire()
                if self.stopping.is_set():
                    semaphore.release()
                    break
                trace = self.store.load_trace(trace_id)
                plan = {p.turn_index: p for p in self.plan(trace)}
                group.create_task(first_error(trace, plan, self.store.pending_steps(trace_id)))
        for trace_id in touched:
            self.store.mark_trace_done(trace_id)
        return num_labeled

    def _finish_skipped(self, trace: Trace, turn_index: int) -> None:
        self.store.finish_step(
            trace.trace_id,
            turn_index,
            status="skipped",
            outcome="after_error",
            process_reward=None,
            trace_share=None,
            best_share=None,
            num_votes=0,
            votes=[],
            cost_usd=0.0,
            pair=None,
        )

    async def _ask_all(
        self, trace: Trace, planned: PlannedStep, messages: list[dict[str, str]]
    ) -> list[Answer]:
        order = self.pool.cascade_order(messages)
        deadline = time.monotonic() + self.cfg.step_timeout_s
        agent = agent_messages(trace, planned.turn_index)
        context_ids = trace.turns[planned.turn_index].prompt_token_ids

        def ask(endpoint: TeacherEndpointConfig) -> Awaitable[Answer]:
            if endpoint.protocol == "review":
                return self.pool.ask(endpoint, messages, trace.trace_id, planned.turn_index, deadline)
            ids = context_ids if endpoint.send_token_ids and context_ids else None
            return self.pool.ask(endpoint, agent, trace.trace_id, planned.turn_index, deadline, token_ids=ids)

        if not self.cfg.gate.cascade or len(order) == 1:
            return list(await asyncio.gather(*(ask(e) for e in order)))
        first = await ask(order[0])
        trace_key = turn_action(trace.turns[planned.turn_index]).key
        agrees = first.action is not None and first.action.key == trace_key
        if agrees and planned.features.get("uncertainty", 0.0) < self.cfg.gate.escalate_uncertainty:
            return [first]
        return [first, *await asyncio.gather(*(ask(e) for e in order[1:]))]

    async def label(self, trace: Trace, planned: PlannedStep) -> StepLabel | None:
        """Ask the teachers at one step and store its label (and pair candidate)."""
        turn_index = planned.turn_index
        messages = teacher_messages(trace, turn_index, self.cfg.instructions)
        budget = self.pool.budget
        while True:  # refused for money: wait for calls in flight to settle, then try again
            generation = budget.generation
            answers = await self._ask_all(trace, planned, messages)
            if not all(a.outcome == "budget" for a in answers):
                break
            if not await budget.wait_for_release(generation):  # nothing in flight: final
                self.pool.record_refusals(answers)
                self._finish_budget(trace, turn_index, answers)
                return None
        self.pool.record_refusals(answers)  # a teacher of the cascade the budget did not cover
        trace_action = turn_action(trace.turns[turn_index])
        votes = [Vote(a.teacher, a.action, a.dollars, a.error) for a in answers]
        label = label_step(trace_action, votes, self.cfg.pairs)
        cost = sum(a.dollars for a in answers)
        outcome: str = label.outcome
        pair = None
        if label.outcome == "pair":
            assert label.chosen is not None
            pair = await self._candidate(trace, planned, trace_action, label, answers, cost)
            if pair is None:
                outcome = "pair_unmatched"
        inserted = self.store.finish_step(
            trace.trace_id,
            turn_index,
            status="done",
            outcome=outcome,
            process_reward=label.process_reward,
            trace_share=label.trace_share,
            best_share=label.best_share,
            num_votes=label.num_votes,
            votes=_vote_records(answers),
            cost_usd=cost,
            pair=pair,
        )
        if pair is not None and not inserted:
            logger.debug("duplicate pair at %s step %d not stored again", trace.trace_id, turn_index)
        disagreed = label_of(outcome)
        if self.voi is not None and disagreed is not None:
            self.voi.update(planned.features, planned.features.get("prior", planned.score), disagreed)
        return label

    def _finish_budget(self, trace: Trace, turn_index: int, answers: list[Answer]) -> None:
        self.store.finish_step(
            trace.trace_id,
            turn_index,
            status="budget",
            outcome="budget",
            process_reward=None,
            trace_share=None,
            best_share=None,
            num_votes=0,
            votes=_vote_records(answers),
            cost_usd=0.0,
            pair=None,
        )

    async def _candidate(
        self,
        trace: Trace,
        planned: PlannedStep,
        trace_action: Action,
        label: StepLabel,
        answers: list[Answer],
        cost: float,
    ) -> PairCandidate | None:
        assert label.chosen is not None
        turn = trace.turns[planned.turn_index]
        context = student_messages(trace, planned.turn_index)
        chosen_text, chosen_ids, source = render_action(label.chosen), None, "teacher"
        if self.student is not None:
            asked = agent_messages(trace, planned.turn_index)
            exact = turn.prompt_token_ids if self.cfg.pairs.on_policy.send_token_ids else None
            samples = await self.student.sample(asked, salt=planned.state_hash, token_ids=exact or None)
            match = next(
                (s for s in samples if s.action is not None and s.action.key == label.chosen.key), None
            )
            if match is not None:
                chosen_text, chosen_ids, source = match.text, match.token_ids, "student"
            elif self.cfg.pairs.on_policy.require_match:
                return None
        return PairCandidate(
            trace_id=trace.trace_id,
            turn_index=planned.turn_index,
            state_hash=planned.state_hash,
            chosen_key=label.chosen.key,
            rejected_key=trace_action.key,
            context_messages=context,
            chosen_text=chosen_text,
            rejected_text=render_action(trace_action),
            context_ids=turn.prompt_token_ids,
            chosen_ids=chosen_ids,
            rejected_ids=turn.token_ids,
            chosen_source=source,
            label_smoothing=label.label_smoothing,
            vote_share=label.best_share,
            margin=label.margin,
            process_reward=label.process_reward,
            provenance={
                "teachers": [a.teacher for a in answers],
                "outcomes": {a.teacher: a.outcome for a in answers},
                "votes": label.clusters,
                "cost_usd": cost,
                "trace_source": trace.source,
                "rejected_truncated": turn.finish_reason == "length",
            },
        )


def _vote_records(answers: list[Answer]) -> list[dict[str, Any]]:
    return [
        {
            "teacher": a.teacher,
            "outcome": a.outcome,
            "action": a.action.key if a.action is not None else None,
            "dollars": a.dollars,
            "error": a.error,
        }
        for a in answers
    ]


def reference_pass(
    store: TeacherStore, scorer: ReferenceScorer, max_pair_tokens: int, batch: int = 32
) -> int:
    """Tokenize and score every pending pair; returns how many became ready."""
    num_ready = 0
    while rows := store.pairs_needing_reference(batch):
        ready, sequences = [], []
        for row in rows:
            context = json.loads(row["context_ids"]) if row["context_ids"] else None
            if context is None:
                context = scorer.context_ids(json.loads(row["context_messages"]))
            chosen = (
                scorer.end_with_eos(json.loads(row["chosen_ids"]))
                if row["chosen_ids"]
                else scorer.completion_ids(row["chosen_text"])
            )
            # A rejected side cut at the token budget is kept as sampled: the policy never sampled
            # an end token there, so none is added (it would teach away from one it did not emit).
            truncated = bool(json.loads(row["provenance"]).get("rejected_truncated"))
            if row["rejected_ids"]:
                rejected = json.loads(row["rejected_ids"])
                rejected = rejected if truncated else scorer.end_with_eos(rejected)
            else:
                rejected = scorer.completion_ids(row["rejected_text"], end=not truncated)
            length = len(context) + max(len(chosen), len(rejected))
            if length > max_pair_tokens:
                store.set_pair_status(
                    row["pair_id"],
                    "too_long",
                    f"{length} tokens > teacher.pairs.max_pair_tokens = {max_pair_tokens}",
                )
                continue
            ready.append((row["pair_id"], context, chosen, rejected))
            sequences += [(context, chosen), (context, rejected)]
        scores = scorer.score(sequences) if sequences else []
        for k, (pair_id, context, chosen, rejected) in enumerate(ready):
            store.set_pair_ready(
                pair_id,
                context_ids=context,
                chosen_ids=chosen,
                rejected_ids=rejected,
                ref_chosen=scores[2 * k],
                ref_rejected=scores[2 * k + 1],
                reference_model=scorer.name,
            )
            num_ready += 1
    return num_ready
