"""Entry point: python -m fully_async.runner [group=option ...] [key=value ...]

Validates the config (before any heavy import), prints the effective limits, starts Ray, builds the actors, runs
the trainer loop, and shuts everything down (engines included) on success, error or Ctrl-C. `--cfg job` prints the
composed config; `hydra.run.dir=DIR` chooses the run directory (and `trainer.resume=auto` resumes from it).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import hydra
from omegaconf import DictConfig

from fully_async.config import ConfigError, build_config, check_overrides, expand_overrides, register_defaults

# Hydra flags that take a value: their value is not an override.
_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                     "--config-dir", "-cd", "--experimental-rerun", "--shell-completion", "-sc"}  # fmt: skip


def _overrides(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = arg in _FLAGS_WITH_VALUE
        else:
            out.append(arg)
    return out


@hydra.main(config_path="config", config_name="fully_async", version_base=None)
def main(composed: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    try:
        cfg = build_config(composed)
    except ConfigError as e:  # Hydra would print a traceback; the message alone says what to fix
        print(f"ConfigError: {e}", file=sys.stderr)
        sys.exit(2)
    run_dir = HydraConfig.get().runtime.output_dir
    print("fully_async: effective limits:", ", ".join(f"{k}={v}" for k, v in cfg.limits().items()), flush=True)
    print(f"fully_async: run dir {run_dir}", flush=True)

    import ray  # heavy imports only after the config is known to be good

    from fully_async.data import DataError
    from fully_async.engines import EngineError
    from fully_async.loggers import LoggerError
    from fully_async.message_queue import create_message_queue
    from fully_async.models import resolve_run_model
    from fully_async.param_sync import ParamSync, ParamSyncError, default_weights_root
    from fully_async.rollouter import create_rollouter
    from fully_async.trace import Tracer
    from fully_async.trainer import Trainer, TrainerError
    from fully_async.training import build_backend

    # Expected failures: the message names the cause, so no traceback is printed for them.
    run_errors = (ConfigError, DataError, EngineError, LoggerError, TrainerError, ParamSyncError,
                  ray.exceptions.RayError)  # fmt: skip

    try:
        model_path = str(resolve_run_model(cfg))
    except ConfigError as e:
        print(f"ConfigError: {e}", file=sys.stderr)
        sys.exit(2)
    # A local Ray starts its workers at niceness 15: the trainer ranks and the engines (children of the Rollouter)
    # then lose the cores to any other process on the host; measured on 2 shared cores, an update took 1.9x as long
    # as the same code at niceness 0. They are the job, so they run at the driver's priority. (A cluster started
    # with `ray start` takes the variable from the environment of that command.)
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, logging_level=logging.WARNING)
    rollouter = backend = sync = None
    try:
        at = cfg.async_training
        queue = create_message_queue(at.effective_queue_capacity(), at.max_staleness)
        rollouter_cpus, trainer_cpus = _cpu_split(cfg)
        rollouter = create_rollouter(cfg, model_path, run_dir, queue, cpu_set=rollouter_cpus)
        print("fully_async: data:", ray.get(rollouter.prepare.remote()), flush=True)
        backend = build_backend(
            cfg.trainer, cfg.algorithm, model_path, temperature=cfg.rollout.temperature, cpu_set=trainer_cpus
        )
        engine_dtype = "float32" if cfg.engine.dtype == "auto" and not _cuda() else cfg.engine.dtype
        tracer = Tracer(run_dir, "trainer", cfg.logger.trace)  # trainer and sync lanes of the event trace
        sync = ParamSync(rollouter, backend, default_weights_root(run_dir), engine_dtype.replace("auto", "bfloat16"),
                         at.sync_timeout_s, tracer)  # fmt: skip
        trainer = Trainer(cfg, backend, queue, rollouter, sync, run_dir, tracer)
        start_kwargs = {}
        if (ckpt := trainer.find_checkpoint()) is not None:
            start_kwargs = trainer.restore(ckpt)
            start_kwargs["weights"] = (str(sync.export(trainer.version)), trainer.version)
        print("fully_async: starting engines:", ray.get(rollouter.start.remote(**start_kwargs)), flush=True)
        final = trainer.run()
        print(f"fully_async: done, step {trainer.step}, reward/mean {final.get('reward/mean', float('nan')):.3f}")
        print(f"fully_async: timeline and summary: python -m fully_async.report {run_dir}")
    except run_errors as e:
        print(f"fully_async: FAILED: {type(e).__name__}: {_cause(e)}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        if rollouter is not None:
            ray.get(rollouter.shutdown.remote(), timeout=120)
        if backend is not None:
            backend.shutdown()
        if sync is not None:
            sync.close()
        ray.shutdown()


def _cause(e: BaseException) -> str:
    """The remote exception's own message for errors raised inside Ray actors."""
    return str(getattr(e, "cause", None) or e).strip().splitlines()[-1] if str(e) else repr(e)


def _cpu_split(cfg) -> tuple[list[int] | None, list[int] | None]:
    """On a CPU host shared with the engines: (cores of the Rollouter and everything it starts = the engines' cores,
    cores of the trainer = the rest); (None, None) when there is no rest or no CPU engine.

    Measured on 2 cores: a trainer whose OpenMP threads share a core with a generating engine took 1.1 s for a
    log-prob pass that takes 0.05 s alone; with the Rollouter, engine API servers and reward workers on the engine's
    core as well, the default job's update took 0.26 s instead of 0.32 s."""
    if _cuda() or cfg.engine.kind != "vllm":
        return None, None
    from fully_async.engines.vllm import engine_cpus, host_cpus

    engines = engine_cpus(cfg.engine.num_servers)
    rest = sorted(set(host_cpus()) - engines)
    return (sorted(engines), rest) if rest else (None, None)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _terminate(signum, frame):
    # SIGTERM (a scheduler, `kill`) unwinds like Ctrl-C, so engines and Ray are shut down by main()'s finally.
    raise KeyboardInterrupt(f"signal {signum}")


def cli() -> int:
    signal.signal(signal.SIGTERM, _terminate)
    try:
        sys.argv[1:] = expand_overrides(sys.argv[1:])  # logger=[a,b] -> logger.backends=[a,b], before Hydra parses argv
        check_overrides(_overrides(sys.argv[1:]))
        register_defaults()
        main()
    except ConfigError as e:
        print(f"ConfigError: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fully_async: interrupted; engines and Ray were shut down", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(cli())
