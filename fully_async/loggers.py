"""Metric sinks chosen by `logger.backends`: console (rich live view), jsonl (RUN_DIR/metrics.jsonl), wandb,
tensorboard. Each gets every step's metrics dict once, after the step; `build_loggers` returns one object that fans
out to all of them.

wandb reads its API key from WANDB_API_KEY (never from config, never logged) and honours WANDB_MODE=offline; its run
files go under RUN_DIR/wandb and its run id is kept in RUN_DIR/wandb_run_id, so a resumed run continues the same
wandb run. tensorboard event files go under RUN_DIR/tensorboard.

`startup_problems(cfg)` says, before Ray starts (fully_async/preflight.py), why a configured sink could not start:
wandb online with no credentials anywhere wandb looks. Whether each sink's package is installed is config
validation's (LoggerConfig.validate_section).
"""

from __future__ import annotations

import configparser
import math
import netrc
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fully_async.config import LoggerConfig
from fully_async.metrics import JsonlWriter


class LoggerError(RuntimeError):
    """A metric sink could not start (wandb without an API key or network, ...); the message says what to set."""


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numeric entries (wandb and tensorboard take scalars only)."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (bool, int, float)) and math.isfinite(float(v)):
            out[k] = float(v)
    return out


class JsonlLogger:
    def __init__(self, run_dir: Path) -> None:
        self.writer = JsonlWriter(run_dir / "metrics.jsonl")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.writer.write([metrics])

    def close(self) -> None:
        self.writer.close()


ETA_AFTER_STEPS = 3
"""Steps the ETA waits for: the first ones carry the pipeline's fill (engines warming up, the first batches being
generated while the trainer waits) and say little about the rest; the ETA is the pace since then."""


class ConsoleLogger:
    """A live panel (step, version, reward, staleness, queue, tokens/s, idle ratios, ETA) on a terminal; one plain
    line per step when stdout is not a terminal (log files, CI)."""

    def __init__(self, total_steps: int, start_step: int = 0, console: Any = None, clock: Any = time.monotonic) -> None:
        from rich.console import Console

        self.total, self.start, self.clock = total_steps, start_step, clock
        self._at: dict[int, float] = {}  # step -> when it was logged
        self.console = console or Console()
        self.live = None
        if self.console.is_terminal:
            from rich.live import Live

            self.live = Live(console=self.console, refresh_per_second=4, transient=False)
            self.live.start()

    def eta_s(self, step: int) -> float:
        """Seconds to the last step at the pace since step start + ETA_AFTER_STEPS; NaN before there is one."""
        base = self.start + ETA_AFTER_STEPS
        if step <= base or base not in self._at:
            return math.nan
        now = self._at.get(step, self.clock())
        return (now - self._at[base]) / (step - base) * (self.total - step)

    def line(self, step: int, m: dict[str, Any]) -> str:
        width = 20
        filled = int(width * step / self.total)
        bar = "#" * filled + "." * (width - filled)
        return (
            f"[{bar}] step {step}/{self.total} v{m.get('version', 0)} "
            f"reward {m.get('reward/mean', math.nan):.3f} stale {m.get('staleness/mean', math.nan):.2f}"
            f"/{m.get('staleness/max', math.nan):.0f} tok/s {m.get('perf/generated_tokens_per_s', 0):.0f} "
            f"idle T {m.get('fully_async/trainer/idle_ratio', 0):.2f} R {m.get('fully_async/rollouter/idle_ratio', 0):.2f} "
            f"q {m.get('fully_async/queue/size', 0)} eta {_seconds(self.eta_s(step))}"
        )

    def panel(self, step: int, m: dict[str, Any]) -> Any:
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold cyan", justify="right")
        t.add_column()
        t.add_row("step", f"{step}/{self.total}  (version {m.get('version', 0)})")
        t.add_row("", ProgressBar(total=self.total, completed=step, width=40))
        t.add_row("reward", f"{m.get('reward/mean', math.nan):.3f} (max {m.get('reward/max', math.nan):.3f})")
        t.add_row(
            "staleness", f"mean {m.get('staleness/mean', math.nan):.2f}  max {m.get('staleness/max', math.nan):.0f}"
        )
        t.add_row("queue", f"{m.get('fully_async/queue/size', 0)} groups")
        t.add_row(
            "tokens/s",
            f"generated {m.get('perf/generated_tokens_per_s', 0):.0f}  trained {m.get('perf/tokens_per_s', 0):.0f}",
        )
        t.add_row(
            "idle",
            f"trainer {m.get('fully_async/trainer/idle_ratio', 0):.0%}  "
            f"engines {m.get('fully_async/rollouter/idle_ratio', 0):.0%}",
        )
        t.add_row("step time", f"{m.get('timing_s/step', math.nan):.2f}s")
        eta = self.eta_s(step)
        t.add_row("ETA", "-" if math.isnan(eta) else time.strftime("%H:%M:%S", time.gmtime(eta)))
        return Panel(t, title="fully_async", expand=False)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._at[step] = self.clock()
        if self.live is not None:
            self.live.update(self.panel(step, metrics), refresh=True)
        else:
            print(self.line(step, metrics), flush=True)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


def _seconds(s: float) -> str:
    return "-" if math.isnan(s) else f"{s:.0f}s"


class WandbLogger:
    def __init__(self, cfg: LoggerConfig, run_dir: Path, run_name: str, config: dict[str, Any]) -> None:
        import wandb

        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=cfg.project,
                entity=cfg.entity,
                name=run_name,
                dir=str(run_dir),
                config=config,
                id=run_id,
                resume="allow",
            )
        except Exception as e:  # wandb's errors (no key, no network) say what failed; add which setting fixes it
            raise LoggerError(
                f"wandb could not start a run ({type(e).__name__}: {e}); set WANDB_API_KEY, or WANDB_MODE=offline "
                "to log locally (sync later with `wandb sync RUN_DIR/wandb`)"
            ) from e

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(_scalars(metrics), step=step)

    def close(self) -> None:
        """Finish the run and wait until wandb's service process has written all of it: finish() alone can return
        with the last steps still in that process's buffers (seen on a loaded box: an offline run file without its
        last 2 of 6 steps), and the run directory must be whole when the run ends (`wandb sync` reads it)."""
        import wandb

        self.run.finish()
        wandb.teardown()


class TensorboardLogger:
    def __init__(self, cfg: LoggerConfig, run_dir: Path, run_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("run", f"project {cfg.project}, run {run_name}", 0)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for k, v in _scalars(metrics).items():
            if k != "step":
                self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


WANDB_LOCAL_MODES = ("offline", "disabled", "dryrun")
"""WANDB_MODE values under which wandb needs no account (it writes locally, or nothing)."""


def startup_problems(cfg: LoggerConfig, environ: Mapping[str, str] = os.environ, cwd: Path | None = None) -> list[str]:
    """Why a sink of `cfg.backends` could not start, one line each (none: every one can). Cheap and local: wandb
    online needs credentials where wandb itself reads them (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, a netrc entry
    for its host, an api_key in its settings files); a network failure is still found only when the run starts."""
    if "wandb" not in cfg.backends:
        return []
    settings = _wandb_settings(environ, cwd or Path.cwd())
    mode = (environ.get("WANDB_MODE") or settings.get("mode") or "online").strip().lower()
    if mode in WANDB_LOCAL_MODES or _wandb_has_credentials(environ, settings):
        return []
    return [
        f"logger.backends includes wandb, and wandb (WANDB_MODE={mode}) finds no API key: set WANDB_API_KEY (or "
        "run `wandb login`), or WANDB_MODE=offline to log locally (sync later with `wandb sync RUN_DIR/wandb`), or "
        "remove wandb from logger.backends"
    ]


def _wandb_settings(environ: Mapping[str, str], cwd: Path) -> dict[str, str]:
    """The [default] section of wandb's global settings file, then the working directory's (which wins)."""
    home = Path(environ.get("HOME") or Path.home())
    config_dir = Path(environ.get("WANDB_CONFIG_DIR") or home / ".config" / "wandb")
    out: dict[str, str] = {}
    for path in (config_dir / "settings", cwd / "wandb" / "settings"):
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
        except configparser.Error:  # a file wandb itself would warn about: not ours to refuse the run for
            continue
        if parser.has_section("default"):
            out.update(parser["default"])
    return out


def _wandb_has_credentials(environ: Mapping[str, str], settings: Mapping[str, str]) -> bool:
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE") or settings.get("api_key"):
        return True
    from urllib.parse import urlsplit

    base = environ.get("WANDB_BASE_URL") or settings.get("base_url") or "https://api.wandb.ai"
    home = Path(environ.get("HOME") or Path.home())
    path = Path(environ["NETRC"]).expanduser() if environ.get("NETRC") else home / ".netrc"
    if not path.exists():
        return False
    try:
        return netrc.netrc(str(path)).authenticators(urlsplit(base).netloc) is not None
    except (netrc.NetrcParseError, OSError):  # wandb warns and goes on without it; so do we, without the key
        return False


class Loggers:
    """Fans each step out to every configured sink."""

    def __init__(self, sinks: Sequence[Any]) -> None:
        self.sinks = list(sinks)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for s in self.sinks:
            s.log(step, metrics)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def build_loggers(
    cfg: LoggerConfig, run_dir: str | Path, total_steps: int, start_step: int = 0, config: dict[str, Any] | None = None
) -> Loggers:
    """The sinks of `cfg.backends`, in order. `config` (the run's config as a dict) is stored with the wandb run."""
    run_dir = Path(run_dir)
    run_name = cfg.run_name or run_dir.name
    sinks: list[Any] = []
    for name in cfg.backends:
        if name == "console":
            sinks.append(ConsoleLogger(total_steps, start_step))
        elif name == "jsonl":
            sinks.append(JsonlLogger(run_dir))
        elif name == "wandb":
            sinks.append(WandbLogger(cfg, run_dir, run_name, config or {}))
        elif name == "tensorboard":
            sinks.append(TensorboardLogger(cfg, run_dir, run_name))
        else:  # validate() rejects unknown names; this guards direct callers
            raise ValueError(f"unknown logger backend {name!r}")
    return Loggers(sinks)
