"""In-process GRPO on the built-in tasks: screens task, reward and tiny-model variants in seconds per seed.

No engine, no Ray, no verl: the tiny model (fully_async.models.tiny) answers the ten copy prompts (or the 55 `add`
prompts with --task add; --repeats applies to copy only) with one sampled token, a rule scores it like
fully_async.reward.rule.synthetic_score (1.0 right digit, --format-credit for another digit), and a plain GRPO
update follows with the default run's settings (8 prompts x 8 samples per step, AdamW at 1e-3 with cosine decay over
the run, entropy bonus 0.1, gradient clip 1.0). --stale 1 samples every batch from the weights one update older and
weights the loss by the truncated ratio min(pi / pi_behave, 2), as max_staleness=1 does at its worst. A prompt
is "stuck" when its probability of the right answer ends below 0.5. --filter-groups 1 is DAPO dynamic sampling as
algorithm.filter_groups does it: batches of 8 groups are sampled until 8 groups whose rewards vary are in hand
(constant groups are counted and dropped; at most --max-batches batches a step, then the step trains on what it has),
and the line also reports the filtered share, seconds per run, and the reward of every sampled group per second.

    .venv/bin/python scripts/bench/copy_task.py --seeds 16 --format-credit 0.1 0.0 --repeats 1 5 --init-std 0.02 0.1
    .venv/bin/python scripts/bench/copy_task.py --task guess --seeds 4 --steps 300 --init-std 0.1   # two turns

prints one line per variant: mean last-20 reward, runs with stuck prompts, stuck prompts in all, steps to a 20-step
mean of 0.8. The e2e numbers of docs/benchmarks.md (issue 4) need the real pipeline; this only ranks variants.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import random
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fully_async.config import TinyModelConfig
from fully_async.data import synthetic_rows
from fully_async.models.tiny import build_tiny_model

PROMPTS, SAMPLES = 8, 8


def task_rows(task: str, repeats: int) -> tuple[list[str], list[int]]:
    """The task's distinct prompts, in order, and their answers, taken from the rows the runner trains on."""
    rows = {
        r.messages[0]["content"]: int(r.ground_truth) for r in synthetic_rows(4096, 0, task=task, copy_repeats=repeats)
    }
    if len(rows) != {"copy": 10, "add": 55}[task]:
        raise SystemExit(f"{task}: {len(rows)} distinct prompts in 4096 rows; expected every one")
    texts = sorted(rows)  # copy: digit order; add: (a, b) order, as the single-digit strings sort
    return texts, [rows[t] for t in texts]


def run(
    seed: int,
    steps: int,
    task: str,
    repeats: int,
    format_credit: float,
    init_std: float,
    stale: int,
    models: str,
    filter_groups: int = 0,
    max_batches: int = 64,
) -> dict:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    path = build_tiny_model(TinyModelConfig(init_std=init_std), cache_dir=models)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    behave = copy.deepcopy(model)
    texts, answers = task_rows(task, repeats)
    rows = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    prompts = torch.tensor([list(r["input_ids"]) if hasattr(r, "keys") else list(r) for r in rows])
    digits = torch.tensor([tok.convert_tokens_to_ids(d) for d in "0123456789"])
    targets = digits[torch.tensor(answers)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    rewards, sampled, kept, dropped = [], [], 0, 0
    t_start = time.perf_counter()

    def sample():
        idx = torch.tensor([rng.randrange(len(texts)) for _ in range(PROMPTS)]).repeat_interleave(SAMPLES)
        with torch.no_grad():
            blog = torch.log_softmax((behave if stale else model)(prompts).logits[:, -1], -1)[idx]
            tokens = torch.multinomial(blog.exp(), 1).squeeze(1)
        right = (tokens == targets[idx]).float()
        score = torch.where(right > 0, right, format_credit * torch.isin(tokens, digits).float())
        return idx, blog, tokens, right, score

    for _ in range(steps):
        idx, blog, tokens, right, score = sample()
        sampled.append(right.mean().item())
        if filter_groups:
            parts, useful = [], 0
            for b in range(max_batches):
                if b:
                    idx, blog, tokens, right, score = sample()
                    sampled[-1] = (sampled[-1] * b + right.mean().item()) / (b + 1)
                varies = score.view(PROMPTS, SAMPLES).std(1) > 0
                kept += int(varies.sum())
                dropped += int((~varies).sum())
                rows = varies.repeat_interleave(SAMPLES)
                parts.append((idx[rows], blog[rows], tokens[rows], right[rows], score[rows]))
                useful += int(varies.sum())
                if useful >= PROMPTS:
                    break
            idx, blog, tokens, right, score = (torch.cat(x)[: PROMPTS * SAMPLES] for x in zip(*parts, strict=True))
            if len(idx) == 0:  # nothing varied within max_batches: no step (as a trainer left waiting)
                sched.step()
                rewards.append(0.0)
                continue
        groups = score.view(-1, SAMPLES)
        adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).view(-1)
        if stale:
            behave.load_state_dict(model.state_dict())  # the next batch comes from the weights before this update
        logp_all = torch.log_softmax(model(prompts).logits[:, -1], -1)[idx]
        logp = logp_all.gather(1, tokens[:, None]).squeeze(1)
        weight = torch.clamp(torch.exp(logp.detach() - blog.gather(1, tokens[:, None]).squeeze(1)), max=2.0)
        entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
        loss = -(weight * adv * torch.exp(logp - logp.detach())).mean() - 0.1 * entropy
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        rewards.append(right.mean().item())
    with torch.no_grad():
        p_right = torch.softmax(model(prompts).logits[:, -1], -1)[torch.arange(len(texts)), targets]
    means = [sum(rewards[i - 19 : i + 1]) / 20 for i in range(19, steps)]
    seconds = time.perf_counter() - t_start
    return {
        "seconds": seconds,
        "first20_all": sum(sampled[:20]) / 20,
        "last20_all": sum(sampled[-20:]) / 20,
        "rate": (sum(sampled[-20:]) - sum(sampled[:20])) / 20 / seconds,
        "filtered": dropped / max(1, kept + dropped),
        "groups": kept + dropped if filter_groups else steps * PROMPTS,
        "last20": means[-1],
        "stuck": [i for i in range(len(texts)) if p_right[i] < 0.5],
        "first08": next((i + 20 for i, m in enumerate(means) if m >= 0.8), None),
    }


def _last_logits(model, seqs: list[list[int]]) -> torch.Tensor:
    """Next-token logits after each sequence, batched by length (a first guess that was the end-of-turn token makes
    its sequence one token shorter: the template's boundary then omits it)."""
    out = [None] * len(seqs)
    by_len: dict[int, list[int]] = {}
    for i, q in enumerate(seqs):
        by_len.setdefault(len(q), []).append(i)
    for rows in by_len.values():
        logits = model(torch.tensor([seqs[i] for i in rows])).logits[:, -1]
        for i, row in zip(rows, logits):
            out[i] = row
    return torch.stack(out)


def run_guess(seed: int, steps: int, init_std: float, models: str) -> dict:
    """The two-turn `guess` task (fully_async/agents/guess.py) in process: a first one-token guess; when it is wrong,
    the environment's answer ('no, it is 77777') and the template's turn boundaries are appended exactly as
    ToolAgentLoop inserts them (agents/tokens.py:ChatDelta) and a second guess is sampled; reward 1 when a guess is
    the digit. GRPO over the 8 samples of each digit, both turns' tokens weighted by the sample's advantage."""
    from fully_async.agents.guess import answer
    from fully_async.agents.tokens import ChatDelta
    from fully_async.data import GUESS_PROMPT

    torch.manual_seed(seed)
    rng = random.Random(seed)
    path = build_tiny_model(TinyModelConfig(init_std=init_std), cache_dir=models)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    chat = ChatDelta(tok)
    prompt = chat.render_ids([{"role": "user", "content": GUESS_PROMPT}], add_generation_prompt=True)
    digits = [tok.convert_tokens_to_ids(d) for d in "0123456789"]
    env = {d: chat.delta([{"role": "user", "content": answer(None, d)}]) for d in range(10)}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    rewards, second = [], []
    n = PROMPTS * SAMPLES
    first_in = torch.tensor([prompt] * n)
    for _ in range(steps):
        answer_of = [rng.randrange(10) for _ in range(PROMPTS) for _ in range(SAMPLES)]
        with torch.no_grad():
            t1 = torch.multinomial(torch.softmax(model(first_in).logits[:, -1], -1), 1).squeeze(1)
            seqs = [prompt + [int(a)] + chat.boundary(int(a)) + env[d] for a, d in zip(t1, answer_of)]
            t2 = torch.multinomial(torch.softmax(_last_logits(model, seqs), -1), 1).squeeze(1)
        hit1 = torch.tensor([int(a) == digits[d] for a, d in zip(t1, answer_of)], dtype=torch.float32)
        hit2 = torch.tensor([int(b) == digits[d] for b, d in zip(t2, answer_of)], dtype=torch.float32)
        turn2 = 1 - hit1
        score = torch.maximum(hit1, hit2 * turn2)
        groups = score.view(PROMPTS, SAMPLES)
        adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).view(-1)
        lp1_all = torch.log_softmax(model(first_in).logits[:, -1], -1)
        lp2_all = torch.log_softmax(_last_logits(model, seqs), -1)
        lp1 = lp1_all.gather(1, t1[:, None]).squeeze(1)
        lp2 = lp2_all.gather(1, t2[:, None]).squeeze(1)
        tokens = n + turn2.sum()
        entropy = (
            -(lp1_all.exp() * lp1_all).sum(-1).sum() - (turn2 * (lp2_all.exp() * lp2_all).sum(-1)).sum()
        ) / tokens
        loss = -(adv * (lp1 + turn2 * lp2)).sum() / tokens - 0.1 * entropy
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        rewards.append(score.mean().item())
        second.append((hit2 * turn2).sum().item() / max(1.0, turn2.sum().item()))
    means = [sum(rewards[i - 19 : i + 1]) / 20 for i in range(19, steps)]
    return {
        "first10": sum(rewards[:10]) / 10,
        "last20": means[-1],
        "second_turn_last20": sum(second[-20:]) / 20,
        "first05": next((i + 20 for i, m in enumerate(means) if m >= 0.5), None),
        "first08": next((i + 20 for i, m in enumerate(means) if m >= 0.8), None),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--task", nargs="+", default=["copy"], choices=["copy", "add", "guess"])
    p.add_argument("--format-credit", type=float, nargs="+", default=[0.1])
    p.add_argument("--repeats", type=int, nargs="+", default=[1])
    p.add_argument("--init-std", type=float, nargs="+", default=[0.02])
    p.add_argument("--stale", type=int, nargs="+", default=[0], choices=[0, 1])
    p.add_argument("--filter-groups", type=int, nargs="+", default=[0], choices=[0, 1])
    p.add_argument("--max-batches", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as models:
        if "guess" in args.task:
            for std in args.init_std:
                t0 = time.perf_counter()
                res = [run_guess(s, args.steps, std, models) for s in range(args.seeds)]
                for s, r in enumerate(res):
                    print(f"task=guess init_std={std} seed={s}: {r}", flush=True)
                print(
                    f"task=guess init_std={std}: first10 {statistics.mean(r['first10'] for r in res):.3f}, last20 "
                    f"{statistics.mean(r['last20'] for r in res):.3f} (second guess right "
                    f"{statistics.mean(r['second_turn_last20'] for r in res):.3f}), 0.5 reached by "
                    f"{sum(r['first05'] is not None for r in res)}/{len(res)}, 0.8 by "
                    f"{sum(r['first08'] is not None for r in res)}/{len(res)} [{time.perf_counter() - t0:.0f} s]",
                    flush=True,
                )
            args.task = [t for t in args.task if t != "guess"]
        variants = itertools.product(
            args.task, args.format_credit, args.repeats, args.init_std, args.stale, args.filter_groups
        )
        for task, credit, reps, std, stale, filt in variants:
            t0 = time.perf_counter()
            res = [
                run(s, args.steps, task, reps, credit, std, stale, models, filt, args.max_batches)
                for s in range(args.seeds)
            ]
            reached = [r["first08"] for r in res if r["first08"] is not None]
            print(
                f"task={task} format_credit={credit:<4} repeats={reps} init_std={std:<4} stale={stale} filter={filt}: "
                f"last20 {statistics.mean(r['last20'] for r in res):.3f}, "
                f"stuck in {sum(bool(r['stuck']) for r in res)}/{len(res)} runs "
                f"({sum(len(r['stuck']) for r in res)} prompts), "
                f"0.8 reached by {len(reached)} (median step {statistics.median(reached) if reached else '-'}); "
                f"all sampled groups: first20 {statistics.mean(r['first20_all'] for r in res):.3f}, "
                f"last20 {statistics.mean(r['last20_all'] for r in res):.3f}; "
                f"reward/s {statistics.median(r['rate'] for r in res):.4f} (median), "
                f"s/run {statistics.median(r['seconds'] for r in res):.1f}, "
                f"filtered {statistics.mean(r['filtered'] for r in res):.2f}, "
                f"groups sampled {statistics.median(r['groups'] for r in res):.0f} (median) "
                f"[{time.perf_counter() - t0:.0f} s]",
                flush=True,
            )


if __name__ == "__main__":
    main()
