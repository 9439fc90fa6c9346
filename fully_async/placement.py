"""Placement: where every engine server, trainer rank and driver-side actor of a run goes, decided by Ray placement
groups, checked before anything starts, and printed as a table.

    plan = Placement.reserve(cfg)      # fails early, with the arithmetic, when the cluster cannot hold the run
    print(plan.table())
    ... trainer ranks in plan.trainer_pgs (verl's RayResourcePool), one engine host per plan.engine_pgs[i] ...
    plan.release()

Resources (`placement.resources`): with gpu, the trainer takes `trainer.nnodes` placement groups of
`trainer.n_gpus_per_node` one-GPU bundles (STRICT_PACK: each group on one node, as verl's RayResourcePool makes
them), and each engine server one bundle of `engine.tensor_parallel_size` GPUs (one node). The groups reserve
disjoint GPUs, so trainer and engine GPUs never overlap. With cpu, the same groups hold CPUs only (logical Ray
CPUs: placement tokens; the real cores are split by fully_async/host.py). The driver (trainer loop, ParamSync),
the MessageQueue and the Rollouter with its reward workers stay on the driver's node.

The table is Ray's actual placement (read back from the granted groups), not a prediction. Before asking Ray,
`check_fit` does the arithmetic on the cluster's nodes, so a run that cannot fit fails in a second with e.g.
"needs 12 GPUs: trainer 8 (1 x 8), engines 2 x 2 = 4; cluster has 8 GPUs on 1 node".
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from fully_async.config import ConfigError, FullyAsyncConfig


class PlacementError(ConfigError):
    """The run does not fit the cluster (or Ray did not grant its resources in time); the message has the numbers."""


@dataclass(frozen=True)
class Node:
    node_id: str
    ip: str
    cpus: float
    gpus: float
    driver: bool = False

    @property
    def short(self) -> str:
        return f"{self.ip}/{self.node_id[:8]}"


def cluster_nodes() -> list[Node]:
    """Alive nodes of the connected Ray cluster; the driver's node first."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    nodes = [
        Node(
            n["NodeID"],
            n["NodeManagerAddress"],
            n["Resources"].get("CPU", 0.0),
            n["Resources"].get("GPU", 0.0),
            n["NodeID"] == here,
        )  # fmt: skip
        for n in ray.nodes()
        if n.get("Alive")
    ]
    return sorted(nodes, key=lambda n: (not n.driver, n.ip, n.node_id))


def uses_gpus(cfg: FullyAsyncConfig, nodes: list[Node]) -> bool:
    if cfg.placement.resources != "auto":
        return cfg.placement.resources == "gpu"
    return sum(n.gpus for n in nodes) > 0


def trainer_roles(cfg: FullyAsyncConfig) -> int:
    """Worker groups sharing each trainer bundle: the policy, the reference model when the KL loss needs it, and the
    critic when the advantage estimator needs one."""
    from fully_async.config.sections import NEEDS_CRITIC

    return 1 + bool(cfg.algorithm.use_kl_loss) + (cfg.algorithm.adv_estimator in NEEDS_CRITIC)


def needs_trainer(cfg: FullyAsyncConfig) -> bool:
    return cfg.trainer.backend == "verl"


def needs_engines(cfg: FullyAsyncConfig) -> bool:
    return cfg.engine.kind != "sim"


def check_fit(cfg: FullyAsyncConfig, nodes: list[Node], gpu: bool) -> None:
    """Raise PlacementError with the arithmetic when the run's groups cannot be packed onto `nodes` (best fit,
    trainer first), in GPUs (gpu) and in logical CPUs (always: each trainer bundle holds one CPU per role, each engine
    bundle placement.engine_cpus). Ray still has the last word (reserve()); this only fails early and says why."""
    tr, en = cfg.trainer, cfg.engine
    roles = float(trainer_roles(cfg))
    dims = [("GPUs", "gpus", 1.0, float(en.tensor_parallel_size))] if gpu else []
    dims.append(("CPUs", "cpus", roles, cfg.placement.engine_cpus))
    for unit, key, per_rank, per_server in dims:
        trainer = [tr.n_gpus_per_node * per_rank] * tr.nnodes if needs_trainer(cfg) else []
        engines = [per_server] * en.num_servers if needs_engines(cfg) else []
        problem = _pack(nodes, key, trainer, engines, unit, tr.nnodes, en.num_servers)
        if problem is None:
            continue
        total = sum(getattr(n, key) for n in nodes)
        per_node = ", ".join(f"{n.short}: {getattr(n, key):g}" for n in nodes)
        parts = []
        if trainer:
            shape = f"{tr.nnodes} x {tr.n_gpus_per_node}" + (f" x {per_rank:g}" if per_rank != 1 else "")
            parts.append(f"trainer {sum(trainer):g} ({shape})")
        if engines:
            parts.append(f"engines {en.num_servers} x {per_server:g} = {sum(engines):g}")
        if unit == "GPUs":
            hint = " (placement.resources=gpu; a CPU-only run: placement.resources=cpu trainer.device=cpu)"
        else:
            hint = " (logical Ray CPUs: start the nodes with more --num-cpus, or lower placement.engine_cpus)"
        raise PlacementError(
            f"needs {sum(trainer) + sum(engines):g} {unit}: {', '.join(parts)}; cluster has {total:g} {unit} on "
            f"{len(nodes)} node{'s' if len(nodes) != 1 else ''} ({per_node}): {problem}{hint}"
        )


def _pack(nodes, key, trainer, engines, unit, nnodes, num_servers) -> str | None:
    """Best-fit packing of the trainer groups (one node each) and then the engine bundles; the first that does not
    fit, in words, or None."""
    free = {n.node_id: getattr(n, key) for n in nodes}
    trainer_nodes: set[str] = set()
    for i, need in enumerate(trainer):
        # One trainer group per node, each on a node of its own (verl's process_on_nodes).
        fits = [n for n in nodes if n.node_id not in trainer_nodes and free[n.node_id] >= need]
        if not fits:
            return f"no node left with {need:g} free {unit} for trainer node {i + 1} of {nnodes}"
        best = min(fits, key=lambda n: free[n.node_id])  # best fit: keep the big nodes for big TP bundles
        free[best.node_id] -= need
        trainer_nodes.add(best.node_id)
    for i, need in enumerate(engines):
        fits = [n for n in nodes if free[n.node_id] >= need]
        if not fits:
            return f"no node has {need:g} free {unit} for engine server {i + 1} of {num_servers}"
        free[min(fits, key=lambda n: free[n.node_id]).node_id] -= need
    return None


def custom(resources: dict) -> dict[str, float]:
    """placement.*_resources as Ray bundle entries."""
    return {str(k): float(v) for k, v in resources.items()}


def engine_bundle(cfg: FullyAsyncConfig, gpu: bool) -> dict[str, float]:
    """The one bundle an engine server reserves: its host's CPUs, its tensor-parallel GPUs (gpu), custom resources."""
    bundle = {"CPU": cfg.placement.engine_cpus} | ({"GPU": float(cfg.engine.tensor_parallel_size)} if gpu else {})
    bundle = {k: v for k, v in bundle.items() if v > 0} | custom(cfg.placement.engine_resources)
    return bundle or {"CPU": 0.001}


def engine_groups(cfg: FullyAsyncConfig, gpu: bool) -> list[Any]:
    """One placement group (one bundle, engine_bundle) per engine server; Ray grants them asynchronously."""
    from ray.util.placement_group import placement_group

    bundle = engine_bundle(cfg, gpu)
    return [
        placement_group([dict(bundle)], strategy="STRICT_PACK", name=f"fully_async_engine_{i}_{time.time_ns()}")
        for i in range(cfg.engine.num_servers)
    ]


def trainer_groups(cfg: FullyAsyncConfig, gpu: bool) -> list[Any]:
    """One placement group per trainer node, one bundle per rank (its CPUs, its GPU, custom resources)."""
    from ray.util.placement_group import placement_group

    tr = cfg.trainer
    bundle = (
        {"CPU": float(trainer_roles(cfg))} | ({"GPU": 1.0} if gpu else {}) | custom(cfg.placement.trainer_resources)
    )
    return [
        placement_group(
            [dict(bundle) for _ in range(tr.n_gpus_per_node)],
            strategy="STRICT_PACK",
            name=f"fully_async_trainer_{i}_{time.time_ns()}",
        )  # fmt: skip
        for i in range(tr.nnodes)
    ]


@dataclass
class Placement:
    """Granted placement groups and the table of who runs where (see the module docstring)."""

    gpu: bool
    nodes: list[Node]
    trainer_pgs: list[Any] = field(default_factory=list)
    engine_pgs: list[Any] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def reserve(cls, cfg: FullyAsyncConfig) -> Placement:
        """Check the arithmetic, then ask Ray for every group and wait (placement.timeout_s) until all are granted.
        Nothing is left reserved when this raises."""
        import ray

        nodes = cluster_nodes()
        gpu = uses_gpus(cfg, nodes)
        check_fit(cfg, nodes, gpu)
        plan = cls(gpu, nodes)
        tr, en, pl = cfg.trainer, cfg.engine, cfg.placement
        try:
            # Larger bundles first: Ray grants groups in order, and a small group placed first can take the node a
            # TP bundle needed (check_fit packs the same way).
            engines_first = gpu and en.tensor_parallel_size > tr.n_gpus_per_node
            if engines_first and needs_engines(cfg):
                plan.engine_pgs = engine_groups(cfg, gpu)
            if needs_trainer(cfg):
                plan.trainer_pgs = trainer_groups(cfg, gpu)
            if not engines_first and needs_engines(cfg):
                plan.engine_pgs = engine_groups(cfg, gpu)
            pgs = plan.trainer_pgs + plan.engine_pgs
            ready, pending = [], []
            if pgs:
                ready, pending = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=pl.timeout_s)
            if pending:
                raise PlacementError(
                    f"Ray granted {len(ready)} of {len(pgs)} placement groups within placement.timeout_s="
                    f"{pl.timeout_s:g}s; the cluster's free resources changed, other jobs hold them, or no node "
                    f"declares the custom resources placement.engine_resources / trainer_resources ask for "
                    f"(ray status shows what is in use)"
                )
            plan.rows = granted_rows(cfg, plan)
        except BaseException:
            plan.release()
            raise
        return plan

    def engine_nodes(self) -> list[str]:
        return [r["node_id"] for r in self.rows if r["role"].startswith("engine server")]

    def trainer_nodes(self) -> list[str]:
        return [r["node_id"] for r in self.rows if r["role"].startswith("trainer rank")]

    def table(self) -> str:
        """The plan as a fixed-width table: node, GPUs, CPUs, role; then the cluster's totals."""
        header = ("node", "GPUs", "CPUs", "role")
        lines = [(f"{r['ip']}/{r['node_id'][:8]}", f"{r['gpus']:g}", f"{r['cpus']:g}", r["role"]) for r in self.rows]
        widths = [max(len(x[i]) for x in [header, *lines]) for i in range(3)]
        out = ["  ".join(h.ljust(w) for h, w in zip(header[:3], widths)) + "  " + header[3]]
        out += ["  ".join(c.ljust(w) for c, w in zip(x[:3], widths)) + "  " + x[3] for x in lines]
        gpus = sum(n.gpus for n in self.nodes)
        out.append(
            f"cluster: {len(self.nodes)} node{'s' if len(self.nodes) != 1 else ''}, {gpus:g} GPUs, "
            f"{sum(n.cpus for n in self.nodes):g} CPUs; reserving {'GPUs' if self.gpu else 'CPUs only'}"
        )
        return "\n".join(out)

    def to_json(self) -> str:
        nodes = [vars(n) for n in self.nodes]
        return json.dumps({"gpu": self.gpu, "nodes": nodes, "rows": self.rows}, indent=1)

    def release(self) -> None:
        """Remove every placement group this plan holds (the actors in them die with them). Idempotent."""
        from ray.util.placement_group import remove_placement_group

        for pg in self.trainer_pgs + self.engine_pgs:
            try:
                remove_placement_group(pg)
            except Exception as e:  # Ray already gone at shutdown: nothing is held any more
                _log_once(f"placement group not removed: {type(e).__name__}: {e}")
        self.trainer_pgs, self.engine_pgs = [], []


def granted_rows(cfg: FullyAsyncConfig, plan: Placement) -> list[dict[str, Any]]:
    """Who runs where, read back from Ray once `plan`'s groups are granted: one row per role (driver-side actors,
    each trainer rank, each engine server) with its node, GPUs and CPUs."""
    from ray.util.placement_group import placement_group_table

    by_id = {n.node_id: n for n in plan.nodes}
    driver = next((n for n in plan.nodes if n.driver), plan.nodes[0])
    rows = [
        {
            "role": "driver (trainer loop, ParamSync)",
            "node_id": driver.node_id,
            "ip": driver.ip,
            "gpus": 0,
            "cpus": 0,
        },
        {"role": "message queue", "node_id": driver.node_id, "ip": driver.ip, "gpus": 0, "cpus": 0},
        {"role": "rollouter + reward workers", "node_id": driver.node_id, "ip": driver.ip, "gpus": 0, "cpus": 0},
    ]
    for i, pg in enumerate(plan.trainer_pgs):
        table = placement_group_table(pg)
        for b, node_id in sorted(table["bundles_to_node_id"].items()):
            node = by_id.get(node_id)
            rows.append({
                "role": f"trainer rank {i * cfg.trainer.n_gpus_per_node + int(b)}", "node_id": node_id,
                "ip": node.ip if node else "?", "gpus": 1 if plan.gpu else 0,
                "cpus": table["bundles"][b].get("CPU", 0),
            })  # fmt: skip
    for i, pg in enumerate(plan.engine_pgs):
        table = placement_group_table(pg)
        node_id = table["bundles_to_node_id"][0]
        node = by_id.get(node_id)
        rows.append({
            "role": f"engine server {i} ({cfg.engine.kind}, tp {cfg.engine.tensor_parallel_size})",
            "node_id": node_id, "ip": node.ip if node else "?",
            "gpus": cfg.engine.tensor_parallel_size if plan.gpu else 0, "cpus": table["bundles"][0].get("CPU", 0),
        })  # fmt: skip
    return rows


_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    import logging

    if message not in _LOGGED:
        _LOGGED.add(message)
        logging.getLogger(__name__).warning("%s", message)
