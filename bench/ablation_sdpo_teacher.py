"""Is SDPO's hinted teacher better than its student on strops? (docs/experiments.md, 2026-12-02)

SDPO distills the policy shown a hint (the teacher) into the policy without it (the student). That
helps only if the teacher, given the hint, puts more probability on the right reply than the
student does. This bench measures it for one model (an SFT warm-up of ``configs/strops.toml``:
``uv run rl @ configs/strops.toml --max-steps 1`` leaves it in ``<output_dir>/sft/final``):

1. greedy exact match on held-out tasks: the student's context, and the teacher's context with the
   sibling hint carrying the *correct* answer (``orchestrator.sdpo`` defaults: ``Hint: A correct
   answer to this task was:\\n<answer>`` as a second user message), rendered by the same chat
   template;
2. teacher-forced on the correct answer: mean log-probability per answer token under each
   context, and the same over the first ``span`` tokens the SDPO loss sees after ``fit_teacher``
   cuts the span to ``seq_len``;
3. on sampled groups (``group_size`` at temperature 1): the hint builder's own targets
   (``HintBuilder.apply``, as the orchestrator builds them; skipped reasons counted), and on their
   span tokens the teacher's minus the student's log-probability, separately for tokens that
   agree with the correct answer so far and for the first wrong token, plus the probability
   each gives the correct token at that first wrong position.

Last line: ``teacher_exact=X student_exact=Y``.

    uv run python bench/ablation_sdpo_teacher.py --model outputs/strops/sft/final
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "environments" / "strops"))

from strops.taskset import StropsConfig, prompt_text, similarity, spaced, split_tasks, transform
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_composer.config.sdpo import HintConfig
from prime_composer.orchestrator.record import EpisodeRecord
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.sdpo.hints import HintBuilder
from prime_composer.orchestrator.sdpo.render import render_ids
from prime_composer.orchestrator.sdpo.target import sdpo_target


def hinted(messages: list[dict[str, Any]], cfg: HintConfig, answer: str) -> list[dict[str, Any]]:
    hint = cfg.hint_format.replace("{hint}", cfg.sibling_format.replace("{solution}", answer))
    return [*messages, {"role": cfg.hint_role, "content": hint}]


@torch.no_grad()
def greedy(model: Any, tok: Any, contexts: list[list[int]], max_tokens: int, eos: int) -> list[str]:
    out = []
    for ids in contexts:
        x = torch.tensor([ids])
        y = model.generate(x, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        out.append(tok.decode(y[0, len(ids) :], skip_special_tokens=True).strip())
    return out


@torch.no_grad()
def token_logprobs(model: Any, context: list[int], target: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """log P(target[i] | context + target[:i]) [n] and the full log-distributions [n, V]."""
    ids = torch.tensor([context + target])
    logits = model(ids).logits[0, len(context) - 1 : len(context) + len(target) - 1].float()
    logp = torch.log_softmax(logits, -1)
    return logp.gather(1, torch.tensor(target)[:, None])[:, 0], logp


def mean_ci(xs: list[float]) -> str:
    n = len(xs)
    if n == 0:
        return "n/a (n=0)"
    m = sum(xs) / n
    if n < 2:
        return f"{m:.3f} (n=1)"
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return f"{m:.3f} +- {1.96 * sd / math.sqrt(n):.3f} (n={n})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--num-tasks", type=int, default=200)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", default="eval")
    p.add_argument("--sibling-format", default=None, help="orchestrator.sdpo.sibling_format to try")
    p.add_argument("--placement", default=None, help="orchestrator.sdpo.placement to try")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    extra: dict[str, Any] = {}
    if args.sibling_format:
        extra["sibling_format"] = args.sibling_format.replace("\\n", "\n")
    if args.placement:
        extra["placement"] = args.placement
    cfg = HintConfig(enabled=True, sources=["sibling", "feedback"], **extra)
    env = StropsConfig(
        split=args.split, operations=["reverse", "rotate"], alphabet_size=6, min_len=4, max_len=8
    )
    tasks = split_tasks(env)[: args.num_tasks]

    # 1 + 2: greedy accuracy and teacher-forced log-probabilities of the correct answer.
    s_ctx, t_ctx, answers, answer_ids = [], [], [], []
    for op, letters in tasks:
        msgs = [{"role": "user", "content": prompt_text(op, letters)}]
        answer = spaced(transform(op, letters))
        student = render_ids(tok, msgs, None)
        if cfg.placement == "message":
            teacher = render_ids(tok, hinted(msgs, cfg, answer), None)
        else:
            hint = cfg.hint_format.replace("{hint}", cfg.sibling_format.replace("{solution}", answer))
            teacher = render_ids(tok, [{"role": "user", "content": f"{msgs[0]['content']}\n\n{hint}"}], None)
        full = tok.encode(
            tok.apply_chat_template([*msgs, {"role": "assistant", "content": answer}], tokenize=False),
            add_special_tokens=False,
        )
        assert full[: len(student)] == student
        # The answer's tokens up to and including <|im_end|>.
        a = full[len(student) :]
        a = a[: a.index(eos) + 1]
        s_ctx.append(student)
        t_ctx.append(teacher)
        answers.append(answer)
        answer_ids.append(a)
    s_out = greedy(model, tok, s_ctx, args.max_tokens, eos)
    t_out = greedy(model, tok, t_ctx, args.max_tokens, eos)
    s_exact = sum(o == a for o, a in zip(s_out, answers, strict=True)) / len(tasks)
    t_exact = sum(o == a for o, a in zip(t_out, answers, strict=True)) / len(tasks)
    print(f"tasks={len(tasks)} split={args.split}")
    print(f"greedy exact: student {s_exact:.3f}, teacher with the correct answer as hint {t_exact:.3f}")
    print(
        f"prefix tokens: student {sum(map(len, s_ctx)) / len(tasks):.1f}, teacher {sum(map(len, t_ctx)) / len(tasks):.1f}"
    )
    d_all, d_span, s_tok, t_tok, spans = [], [], [], [], []
    for sc, tc, a in zip(s_ctx, t_ctx, answer_ids, strict=True):
        ls, _ = token_logprobs(model, sc, a)
        lt, _ = token_logprobs(model, tc, a)
        span = max(0, min(len(a), args.seq_len - len(tc)))
        spans.append(span)
        s_tok.append(ls.mean().item())
        t_tok.append(lt.mean().item())
        d_all.append((lt - ls).mean().item())
        if span:
            d_span.append((lt[:span] - ls[:span]).mean().item())
    print(f"log P(correct answer) per token: student {mean_ci(s_tok)}, teacher {mean_ci(t_tok)}")
    print(f"teacher - student per token, whole answer: {mean_ci(d_all)}")
    print(
        f"teacher - student per token, the first span tokens fit_teacher keeps (mean span {sum(spans) / len(spans):.1f} "
        f"of {sum(map(len, answer_ids)) / len(answer_ids):.1f}): {mean_ci(d_span)}"
    )

    # 3: sampled groups, the hint builder's targets, the signal on their tokens.
    builder = HintBuilder(cfg, tok, args.seq_len)
    samples: list[Sample] = []
    for gid, ((op, letters), sc, answer) in enumerate(zip(tasks, s_ctx, answers, strict=True)):
        x = torch.tensor([sc]).repeat(args.group_size, 1)
        with torch.no_grad():
            y = model.generate(
                x,
                max_new_tokens=args.max_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        for row in y[:, len(sc) :].tolist():
            comp = row[: row.index(eos) + 1] if eos in row else row
            reply = tok.decode(comp, skip_special_tokens=True).strip()
            exact = reply == answer
            reward = 1.0 if exact else 0.5 * similarity(reply, answer)
            feedback = (
                None
                if exact
                else {"text": f"{reply[:40]!r} is not {op} of {spaced(letters)}.", "kind": "wrong_answer"}
            )
            samples.append(
                Sample(
                    prompt_ids=list(sc),
                    completion_ids=comp,
                    completion_logprobs=[0.0] * len(comp),
                    completion_mask=[1] * len(comp),
                    reward=reward,
                    example_id=gid,
                    group_id=gid,
                    policy_step=0,
                    is_truncated=eos not in row,
                    episode=EpisodeRecord(
                        task={"prompt": prompt_text(op, letters), "answer": answer},
                        messages=[
                            {"role": "user", "content": prompt_text(op, letters)},
                            {"role": "assistant", "content": reply},
                        ],
                        feedback=feedback,
                    ),
                )
            )
    stats = asyncio.run(builder.apply(samples))
    print(
        f"sampled {len(samples)}: exact {sum(s.reward == 1.0 for s in samples) / len(samples):.3f}, "
        f"candidates {stats.num_candidates}, hinted {stats.num_hinted}, sources {dict(stats.sources)}, "
        f"skipped {dict(stats.skipped)}, teacher cut {stats.num_teacher_truncated}"
    )
    ok_d, wrong_d, p_fix_t, p_fix_s, kl, span_lens, full_lens = [], [], [], [], [], [], []
    for s in samples:
        target = sdpo_target(s)
        if target is None:
            continue
        start, end = target.span
        span_lens.append(end - start)
        full_lens.append(len(s.completion_ids))
        comp = s.completion_ids[start:end]
        ls, dist_s = token_logprobs(model, s.prompt_ids + s.completion_ids[:start], comp)
        lt, dist_t = token_logprobs(model, target.teacher_prefix_ids, comp)
        kl.append((dist_t.exp() * (dist_t - dist_s)).sum(-1).mean().item())
        answer = answer_ids[s.group_id]
        for i, t in enumerate(comp):
            if start + i < len(answer) and t == answer[start + i]:
                ok_d.append((lt[i] - ls[i]).item())
                continue
            wrong_d.append((lt[i] - ls[i]).item())
            if start + i < len(answer):
                p_fix_t.append(dist_t[i, answer[start + i]].exp().item())
                p_fix_s.append(dist_s[i, answer[start + i]].exp().item())
            break
    print(
        f"targets: span {sum(span_lens) / max(1, len(span_lens)):.1f} tokens of {sum(full_lens) / max(1, len(full_lens)):.1f}"
    )
    print(f"KL(teacher || student) per span token: {mean_ci(kl)}")
    print(f"teacher - student log P on span tokens still right: {mean_ci(ok_d)}")
    print(f"teacher - student log P on the first wrong token: {mean_ci(wrong_d)}")
    print(
        f"P(correct token) at the first wrong position: teacher {mean_ci(p_fix_t)}, student {mean_ci(p_fix_s)}"
    )
    print(f"teacher_exact={t_exact:.4f} student_exact={s_exact:.4f}")


if __name__ == "__main__":
    main()
