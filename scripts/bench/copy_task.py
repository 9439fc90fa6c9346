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
import sys
import tempfile
import time
from pathlib import Path

# This folder holds queue.py (the queue benchmark), which would shadow the standard library's queue module.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from fully_async.config import TinyModelConfig  # noqa: E402
from fully_async.data import synthetic_rows  # noqa: E402
from fully_async.models.tiny import build_tiny_model  # noqa: E402

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--task", nargs="+", default=["copy"], choices=["copy", "add"])
    p.add_argument("--format-credit", type=float, nargs="+", default=[0.1])
    p.add_argument("--repeats", type=int, nargs="+", default=[1])
    p.add_argument("--init-std", type=float, nargs="+", default=[0.02])
    p.add_argument("--stale", type=int, nargs="+", default=[0], choices=[0, 1])
    p.add_argument("--filter-groups", type=int, nargs="+", default=[0], choices=[0, 1])
    p.add_argument("--max-batches", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as models:
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
