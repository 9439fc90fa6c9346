"""Entry point: python -m fully_async.runner [--plan] [group=option ...] [key=value ...]

Validates the command line (every problem at once, before any heavy import; verl's keys are read as ours), checks the
model and the data files (fully_async/preflight.py), prints the effective limits, connects to Ray (RAY_ADDRESS, else a
local one), and hands over to the job (fully_async/job.py), which places, builds, runs and shuts everything down
(engines included) on success, error or Ctrl-C. `--plan` prints the placement table and exits (exit code 2, with the
arithmetic, when the run does not fit). `--cfg job` prints the resolved config once it is valid, each key that a preset,
an older key or a built-in task set marked with where it came from; `hydra.run.dir=DIR` chooses the run directory
(and `trainer.resume=auto` resumes from it).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from fully_async.config import (
    PRIMARY_CONFIG,
    ConfigError,
    FullyAsyncConfig,
    build_config,
    compose,
    expand_overrides,
    register_defaults,
    to_yaml,
)
from fully_async.config.verl_table import is_verl_config_flag
from fully_async.preflight import preflight
from fully_async.startup import Timeline

# Hydra flags that take a value: their value is not an override.
_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                     "--config-dir", "-cd", "--experimental-rerun", "--shell-completion", "-sc"}  # fmt: skip


PLAN_ONLY = False
"""`--plan`: connect to the cluster (RAY_ADDRESS, else a local one), print where everything would run, exit."""


def _split(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Hydra's command line -> (overrides, {flag: value})."""
    out, flags, flag = [], {}, None
    for arg in argv:
        if flag:
            flags[flag], flag = arg, None
        elif is_verl_config_flag(arg):  # names verl's own config: read with the verl keys (config/verl_table.py)
            out.append(arg)
        elif arg.startswith("-"):
            flag = arg if arg in _FLAGS_WITH_VALUE else None
        else:
            out.append(arg)
    return out, flags


def check_command_line(argv: list[str]) -> FullyAsyncConfig:
    """Compose and validate what Hydra will run, raising one ConfigError with every problem of the command line
    (`--cfg job` included, which Hydra would otherwise print unchecked); returns the resolved config."""
    overrides, flags = _split(argv)
    name = flags.get("--config-name") or flags.get("-cn") or PRIMARY_CONFIG
    where = flags.get("--config-dir") or flags.get("-cd") or flags.get("--config-path") or flags.get("-cp")
    # Hydra reads --config-path relative to this file, --config-dir relative to the working directory.
    base = Path(__file__).parent if (flags.get("--config-path") or flags.get("-cp")) else Path.cwd()
    return compose([o for o in overrides if not o.lstrip("+~").startswith("hydra.")],
                   config_dir=(base / where).resolve() if where else None, config_name=name)  # fmt: skip


def _prints_job_config(argv: list[str]) -> bool:
    """`--cfg job` (or `-c job`): printed by us, resolved (Hydra's print shows '???' for a key a preset fills)."""
    _, flags = _split(argv)
    return (flags.get("--cfg") or flags.get("-c")) == "job"


@hydra.main(config_path="config", config_name="fully_async", version_base=None)
def main(composed: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from fully_async.data import DataError

    startup = Timeline("startup")  # from the command's start: the interpreter and the command line's check count
    startup.add("command_line", startup.t0, time.time())
    try:
        with startup.part("config"):
            cfg = build_config(composed)
        print("fully_async: effective limits:", ", ".join(f"{k}={v}" for k, v in cfg.limits().items()), flush=True)
        with startup.part("preflight"):
            model = preflight(cfg, plan_only=PLAN_ONLY)  # the model and the data files, before Ray starts
    except (ConfigError, DataError) as e:  # Hydra would print a traceback; the message alone says what to fix
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)
    run_dir = HydraConfig.get().runtime.output_dir
    print(f"fully_async: run dir {run_dir}", flush=True)

    import ray  # heavy imports only after the config is known to be good

    from fully_async.job import Job, connect_ray, record_failure

    run_errors = _run_errors()
    try:
        with startup.part("ray"):
            connect_ray(cfg)
        with Job(cfg, run_dir, model or "(not resolved for --plan)", startup=startup) as job:
            if PLAN_ONLY:
                job.plan()
                print(f"fully_async: placement plan (device {job.cfg.trainer.device}, engine dtype "
                      f"{job.cfg.engine.dtype}):\n{job.placement.table()}", flush=True)  # fmt: skip
                return
            job.start()
            final = job.run()
        print(f"fully_async: done, step {job.trainer.step}, reward/mean {final.get('reward/mean', float('nan')):.3f}")
        print(f"fully_async: timeline and summary: python -m fully_async.report {run_dir}")
    except ConfigError as e:  # includes PlacementError: the run does not fit the cluster
        print(f"ConfigError: {e}", file=sys.stderr)
        sys.exit(2)
    except run_errors as e:
        log_file = record_failure(run_dir, e)  # the whole traceback, a Ray task's remote one included
        print(f"fully_async: FAILED: {type(e).__name__}: {_cause(e)} (traceback: {log_file})", file=sys.stderr,
              flush=True)  # fmt: skip
        sys.exit(1)
    except Exception as e:  # unexpected: Hydra prints the traceback; the run's log keeps it too
        record_failure(run_dir, e)
        raise
    finally:
        ray.shutdown()


def _run_errors() -> tuple[type[BaseException], ...]:
    """Expected failures of a run: their message names the cause, so no traceback is printed for them (heavy
    imports: call it once the config is known to be good)."""
    import ray

    from fully_async.data import DataError
    from fully_async.engines import EngineError
    from fully_async.job import TrainerLost
    from fully_async.loggers import LoggerError
    from fully_async.sync import ParamSyncError
    from fully_async.trainer import TrainerError

    return (DataError, EngineError, LoggerError, TrainerError, ParamSyncError, TrainerLost, ray.exceptions.RayError)


def _cause(e: BaseException) -> str:
    """The remote exception's own message for errors raised inside Ray actors (the last line of its traceback);
    the first line of one raised here (the lines after it, a stuck sync's diagnosis, go to the run's log)."""
    if not str(e):
        return repr(e)
    cause = getattr(e, "cause", None)
    lines = str(cause or e).strip().splitlines()
    return lines[-1] if cause is not None else lines[0]


def _terminate(signum, frame):
    # SIGTERM (a scheduler, `kill`) unwinds like Ctrl-C, so engines and Ray are shut down by main()'s finally.
    raise KeyboardInterrupt(f"signal {signum}")


def cli() -> int:
    global PLAN_ONLY
    signal.signal(signal.SIGTERM, _terminate)
    if "--plan" in sys.argv[1:]:
        PLAN_ONLY = True
        sys.argv.remove("--plan")
    try:
        cfg = check_command_line(sys.argv[1:])  # says what it read of verl's keys, once
        if _prints_job_config(sys.argv[1:]):
            print(to_yaml(cfg), end="", flush=True)
            return 0
        # Hydra parses argv: give it our spelling (verl keys read, logger=[a,b] -> logger.backends=[a,b], task=X).
        sys.argv[1:] = expand_overrides(sys.argv[1:], problems=[], announce=False)
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
