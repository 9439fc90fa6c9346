"""The job: builds one run's placement, actors, engine pool, backend, ParamSync and Trainer, runs it, tears it down.
Used by the runner (`python -m fully_async.runner`) and the simulation driver alike, so both wire the same things.

    connect_ray(cfg)
    with Job(cfg, run_dir, model_path) as job:   # __exit__ shuts everything down, on success, error or Ctrl-C
        job.start()                              # placement (fails early when the run does not fit), actors,
        final = job.run()                        #   resume, engines healthy; then the trainer loop

Start-up overlaps what does not depend on each other: the engine servers launch (and warm up, engines/warmup.py)
while the trainer ranks build, ParamSync and the Trainer are made; the job waits for the engines only before the
first step. A resumed run is the exception: its engines start on the checkpoint's weights, which the ranks export,
so they launch after the ranks load it. Every part is timed (fully_async/startup.py: one console line after the
first step, `timing_s/startup/*` in its metrics, the trace's `startup` lane), and so is the shutdown
(`RUN_DIR/startup.json`), whose independent parts (the engines' stop, the ranks') run at once too.

Where things run (fully_async/placement.py has the layout): the driver (this process: trainer loop, ParamSync), the
MessageQueue and the Rollouter (with its reward workers) on the driver's node; one `EngineHost` actor per engine
server in its placement-group bundle, on whatever node Ray granted; the trainer ranks in verl's RayResourcePool built
on the plan's trainer groups. The device and the engine dtype come from fully_async/device.py, decided once here and
written into the config every actor gets. `RUN_DIR/placement.json` records the plan and where each engine server and
trainer rank actually ran (node, pid, CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fully_async import console
from fully_async.config import FullyAsyncConfig
from fully_async.startup import Timeline, write_record

log = logging.getLogger(__name__)


def connect_ray(cfg: FullyAsyncConfig) -> None:
    """Join the cluster in RAY_ADDRESS (a `ray job submit` sets it), else start a local Ray for this run.

    A local Ray starts its workers at niceness 15: the trainer ranks and the engines then lose the cores to any other
    process on the host; measured on 2 shared cores, an update took 1.9x as long as the same code at niceness 0.
    They are the job, so they run at the driver's priority (a cluster started by scripts/cluster/ does the same).
    Its logical CPUs are placement tokens (real cores are split by fully_async/device.py), so a local Ray declares at
    least as many as the run's placement groups need."""
    import ray

    from fully_async.placement import engine_server_cpus, needs_engines, needs_trainer, trainer_roles

    if ray.is_initialized():
        return
    console.hold_driver_chatter()  # Ray's token-auth notice, torch's is_fx_tracing: to logs/workers.log
    os.environ.setdefault("RAY_worker_niceness", "0")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level=logging.WARNING)
        return
    tokens = 2 + cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node * trainer_roles(cfg) * needs_trainer(cfg)
    tokens += cfg.engine.num_servers * engine_server_cpus(cfg, gpu=False) * needs_engines(cfg)
    ray.init(num_cpus=max(os.cpu_count() or 1, int(tokens + 0.999)), include_dashboard=False,
             logging_level=logging.WARNING)  # fmt: skip


def resolve_devices(cfg: FullyAsyncConfig, cluster_gpus: float) -> FullyAsyncConfig:
    """A copy of `cfg` with trainer.device and engine.dtype decided (fully_async/device.py): every actor gets these."""
    from fully_async.device import device, engine_dtype

    dev = device(cfg.trainer.device, cluster_gpus)
    return dataclasses.replace(
        cfg,
        trainer=dataclasses.replace(cfg.trainer, device=dev),
        engine=dataclasses.replace(cfg.engine, dtype=engine_dtype(cfg, dev)),
    )


ERROR_LOG = Path("logs") / "error.log"
"""Where in the run directory a failed run's traceback goes (`record_failure`); the console keeps its one line."""


def record_failure(run_dir: str | Path, e: BaseException) -> Path:
    """Append `e`'s full traceback to RUN_DIR/logs/error.log, with the time, and return the file: its causes' (a
    sync phase's error and what it wraps), the notes (a staged export's writer thread's traceback,
    training/hf_files.py) and a Ray task's remote traceback (a RayTaskError's message holds it). The runner prints one
    line naming the cause and this file."""
    import traceback

    path = Path(run_dir) / ERROR_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} the run failed: {type(e).__name__}\n")
        f.write("".join(traceback.format_exception(e)))
    return path


class TrainerLost(RuntimeError):
    """A node that held trainer ranks is gone; the run must be resumed from its last checkpoint."""


def trainer_lost_message(lost: list[str], ips: dict[str, str], ckpt_root: Path) -> str:
    """What to tell the user when trainer nodes are lost: which, the last checkpoint, and how to continue."""
    from fully_async.trainer import latest_checkpoint

    where = ", ".join(f"{ips.get(n, '?')}/{n[:8]}" for n in lost)
    latest = latest_checkpoint(ckpt_root)
    if latest is not None:
        last = f"the last checkpoint is {latest}"
    else:
        last = f"no checkpoint was written yet under {ckpt_root} (trainer.save_every)"
    return (
        f"trainer node(s) lost: {where}; the trainer cannot go on without its ranks' model and optimizer shards. "
        f"{last}; run the same command again with trainer.resume=auto to continue from it (every prompt trained "
        f"exactly once)"
    )


class Job:
    def __init__(
        self,
        cfg: FullyAsyncConfig,
        run_dir: str | Path,
        model_path: str | Path,
        *,
        weights_root: Path | None = None,
        echo: Callable[[str], None] | None = None,
        startup: Timeline | None = None,
    ) -> None:
        """`weights_root`: where ParamSync writes weights (default: a fresh directory under /dev/shm);
        `echo`: progress lines (default: print to stdout); `startup`: the start-up's timeline so far (the runner's
        parts before the job; default: a new one from this process's start)."""
        self.cfg, self.run_dir, self.model_path = cfg, Path(run_dir), str(model_path)
        self.startup = startup or Timeline("startup")
        self.startup.on_finish = lambda timeline: self.echo(timeline.line())  # at the first step's end
        self.weights_root = weights_root
        self.echo = echo or (lambda line: print(f"fully_async: {line}", flush=True))
        self.placement = self.queue = self.rollouter = self.backend = self.sync = self.trainer = None
        self.hosts: list[Any] = []
        self.host_factory = None

    # ------------------------------------------------------------------------------------------------ build
    def plan(self):
        """Reserve the run's placement groups (PlacementError with the arithmetic when they cannot fit)."""
        from fully_async.placement import Placement, cluster_nodes

        with self.startup.part("placement"):
            nodes = cluster_nodes()
            self.cfg = resolve_devices(self.cfg, sum(n.gpus for n in nodes))
            self.placement = Placement.reserve(self.cfg)
        return self.placement

    def start(self) -> dict[str, Any]:
        """Build every part and start the engines (resuming from a checkpoint when trainer.resume says so)."""
        import ray

        from fully_async.device import cpu_split
        from fully_async.engines.auth import ensure_token
        from fully_async.handles import rollouter_name
        from fully_async.message_queue import create_message_queue
        from fully_async.rollouter import create_rollouter
        from fully_async.trace import Tracer
        from fully_async.trainer import Trainer

        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Worker output (verl's import warnings per rank, retry storms) to RUN_DIR/logs/workers.log; the console gets
        # each kind of line once, then counts (fully_async/console.py). Undone by shutdown().
        console.install(self.run_dir)
        if self.placement is None:
            self.plan()
        cfg, at = self.cfg, self.cfg.async_training
        self.echo(
            f"placement (device {cfg.trainer.device}, engine dtype {cfg.engine.dtype}):\n{self.placement.table()}"
        )
        driver_node = ray.get_runtime_context().get_node_id()
        token = ensure_token()  # for servers off loopback (engines/auth.py); never printed
        engine_side, trainer_side = cpu_split(cfg, cfg.trainer.device)
        self.queue = create_message_queue(at.effective_queue_capacity(), at.max_staleness, node_id=driver_node)
        self.rollouter = create_rollouter(
            cfg, self.model_path, str(self.run_dir), self.queue, cpu_set=engine_side, node_id=driver_node,
            engine_token=token, name=rollouter_name(self.run_dir),
        )  # fmt: skip
        with self.startup.part("data"):
            self.echo(f"data: {ray.get(self.rollouter.prepare.remote())}")
        self.hosts = self._engine_hosts(driver_node, engine_side, token)
        resuming = self._resuming()
        engines = None if resuming else self._start_engines({})  # beside the ranks' build below
        with self.startup.part("trainer_ranks"):
            self.backend = self._backend(trainer_side)
        tracer = Tracer(str(self.run_dir), "trainer", cfg.logger.trace)  # trainer and sync lanes of the event trace
        self.sync = self._param_sync(tracer)
        self.trainer = Trainer(cfg, self.backend, self.queue, self.rollouter, self.sync, str(self.run_dir), tracer)
        self.trainer.startup = self.startup
        if resuming:
            with self.startup.part("restore"):
                start_kwargs: dict[str, Any] = {}
                if (ckpt := self.trainer.find_checkpoint()) is not None:
                    start_kwargs = self.trainer.restore(ckpt)
                    start_kwargs["weights"] = (str(self.sync.export(self.trainer.version)), self.trainer.version)
            engines = self._start_engines(start_kwargs)
        with self.startup.part("wait_engines"):
            started = ray.get(engines)
        for name, (begin, end) in started.pop("startup", {}).items():  # the rollouter's parts: launch, warm-up
            self.startup.add(name, begin, end)
        self.echo(f"engines: {started}")
        self._record_where()
        return started

    def _backend(self, trainer_side: Any) -> Any:
        """The training backend on the trainer's share of the CPUs and its placement groups; its log-probs are taken
        at the rollout's temperature and, where the engine reports truncated ones, its top-k / nucleus."""
        from fully_async.engines import logprobs_truncated
        from fully_async.training import build_backend
        from fully_async.training.sampling_support import SamplingSupport

        cfg = self.cfg
        return build_backend(
            cfg.trainer, cfg.algorithm, self.model_path, temperature=cfg.rollout.temperature,
            support=SamplingSupport.of_rollout(cfg.rollout, logprobs_truncated(cfg.engine.kind)),
            cpu_set=trainer_side, placement_groups=self.placement.trainer_pgs or None, lora=cfg.model.lora,
            freeze_vision_tower=cfg.model.freeze_vision_tower, distill=cfg.distill,
        )  # fmt: skip

    def _param_sync(self, tracer: Any) -> Any:
        """The run's ParamSync over its weights root (a fresh /dev/shm one unless given) and its transport: the
        configured one, or the adapter sync where a LoRA run can sync adapters (said once, with why not otherwise)."""
        from fully_async.sync import ParamSync, default_weights_root
        from fully_async.weights.disk import claim_weights_root
        from fully_async.weights.lora import adapter_sync_plan

        cfg, at = self.cfg, self.cfg.async_training
        root = self.weights_root
        if root is None:  # a fresh /dev/shm root: the run directory records it, and a resume removes a killed run's
            root = default_weights_root(self.run_dir)
            claim_weights_root(self.run_dir, root)
        lora, why = adapter_sync_plan(cfg, cfg.trainer.device)
        if why:
            self.echo(f"LoRA: versions sync as merged full weights (async_training.weight_transport): {why}")
        elif lora:
            self.echo("LoRA: versions sync as adapters (policy-v<version>, loaded without pausing the engines)")
        knobs = cfg.advanced
        return ParamSync(self.rollouter, self.backend, root, cfg.engine.dtype, knobs.sync_timeout_s, tracer,
                         transport="adapter" if lora else at.weight_transport, bucket_mb=knobs.bucket_mb,
                         device=cfg.trainer.device, mode=at.sync_mode, verify=at.verify_sync,
                         staging=knobs.staging)  # fmt: skip

    def _resuming(self) -> bool:
        """Whether this run starts from a checkpoint (trainer.resume), so its engines must load that checkpoint's
        weights before they serve."""
        from fully_async.trainer import latest_checkpoint

        resume = self.cfg.trainer.resume
        if resume == "none":
            return False
        return resume != "auto" or latest_checkpoint(self.run_dir / "checkpoints") is not None

    def _start_engines(self, start_kwargs: dict[str, Any]) -> Any:
        """Send the rollouter's start (engines launched, warmed up, then generating); its reference, not awaited."""
        return self.rollouter.start.remote(hosts=self.hosts or None, host_factory=self.host_factory, **start_kwargs)

    def _engine_hosts(self, driver_node: str, cpu_set: list[int] | None, token: str) -> list[Any]:
        """One EngineHost actor per engine server, each in its placement group's bundle; the factory that made them
        goes to the Rollouter, which places the hosts of servers added or replaced later the same way."""
        from fully_async.engines.host import HostFactory

        groups = self.placement.engine_pgs
        self.host_factory = HostFactory(
            self.cfg, str(self.run_dir), driver_node, cpu_set, token, self.placement.gpu, groups
        )  # fmt: skip
        return [self.host_factory.spawn(i, pg) for i, pg in enumerate(groups)]

    def _record_where(self) -> None:
        """RUN_DIR/placement.json: the plan's rows, and where engine servers and trainer ranks actually run."""
        import ray

        engines = ray.get([h.where.remote() for h in self.hosts], timeout=60) if self.hosts else []
        ranks = self.backend.where() if hasattr(self.backend, "where") else []
        record = json.loads(self.placement.to_json()) | {"engines": engines, "trainer_ranks": ranks}
        (self.run_dir / "placement.json").write_text(json.dumps(record, indent=1))

    # ------------------------------------------------------------------------------------------------ run
    def run(self) -> dict[str, float]:
        """The trainer loop; returns the last step's metrics. A trainer rank's node lost is not survivable in-run
        (its shard of the model and optimizer is gone): TrainerLost names the node and the checkpoint to resume from."""
        try:
            return self.trainer.run()
        except Exception as e:
            import ray

            nodes = self.placement.trainer_nodes() if self.placement is not None else []
            alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
            lost = sorted({n for n in nodes if not alive.get(n, False)})
            if not lost:
                raise
            ips = {n.node_id: n.ip for n in self.placement.nodes}
            raise TrainerLost(trainer_lost_message(lost, ips, self.trainer.ckpt_root)) from e

    def shutdown(self) -> None:
        """Stop engines, reward workers, trainer ranks and actors, and free the placement groups. Safe to call twice
        and after a failed start; each part is stopped even when an earlier one fails to. The rollouter (which stops
        the engines and reward workers) and the trainer ranks share nothing, so they stop at once, while the
        trainer's plot is drawn; each part is timed into RUN_DIR/startup.json (`shutdown`)."""
        import ray

        from fully_async.engines.host import stop_hosts

        timeline = Timeline("shutdown", t0=time.time())
        at_once = [
            ("rollouter", lambda: self.rollouter and ray.get(self.rollouter.shutdown.remote(), timeout=120)),
            ("trainer_ranks", lambda: self.backend and self.backend.shutdown()),
            ("plots", lambda: self.trainer and self.trainer.wait_plots()),
        ]
        threads = [threading.Thread(target=self._stop_part, args=(timeline, name, step), name=f"stop-{name}")
                   for name, step in at_once]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        steps = [
            ("param_sync", lambda: self.sync and self.sync.close()),
            ("engine_hosts", lambda: self.hosts and stop_hosts(self.hosts, 60)),
            ("actors", lambda: [ray.kill(a) for a in (*self.hosts, self.rollouter, self.queue) if a is not None]),
            ("placement", lambda: self.placement and self.placement.release()),
        ]  # fmt: skip
        for name, step in steps:
            self._stop_part(timeline, name, step)
        started = self.rollouter is not None
        self.hosts, self.rollouter, self.queue, self.backend, self.sync = [], None, None, None, None
        console.uninstall()
        if started and self.run_dir.is_dir():
            timeline.finish()
            self.echo(timeline.line())
            write_record(self.run_dir, self.startup, timeline)

    @staticmethod
    def _stop_part(timeline: Timeline, name: str, step: Callable[[], Any]) -> None:
        from fully_async.handles import one_line

        try:
            with timeline.part(name):
                step()
        except Exception as e:  # the remaining parts must still be stopped; this one is reported
            log.warning("shutdown of %s failed: %s", name, one_line(e))
            log.debug("shutdown of %s failed", name, exc_info=True)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
