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
CPUs: placement tokens; the real cores are split by fully_async/device.py). The driver (trainer loop, ParamSync),
the MessageQueue and the Rollouter with its reward workers stay on the driver's node.

The table is Ray's actual placement (read back from the granted groups), not a prediction. Before asking Ray,
`check_fit` does the arithmetic on the cluster's nodes, so a run that cannot fit fails in a second with e.g.
"needs 12 GPUs: trainer 8 (1 x 8), engines 2 x 2 = 4; cluster has 8 GPUs on 1 node".

The same packing (`check_fit`'s, best fit in a fixed node order) decides each group's node, and every group is
created with that node as its target (`_soft_target_node_id`), so `--plan` and the job, each reserving on its own,
map the same servers to the same nodes: left to itself, Ray picks among equally good nodes in no fixed order (a
`--plan` showed the servers of a 2-node run on the nodes the job then swapped, in 3 of 8 runs), and even a node
given as a hint (`_soft_target_node_id`) was passed over while it was busy for a moment (CI: 4 of 4 reservations
swapped). So each group is first pinned to its node (a label selector on `ray.io/node-id`, which Ray must honour)
for up to PIN_GRACE_S; only a group still waiting then is asked again with its node as a hint: when the node has no
room (other jobs hold it), Ray places the group elsewhere, the table says where, and a warning names the group.
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


@dataclass(frozen=True)
class Assignment:
    """The node each placement group targets: one per trainer group (trainer node), one per engine server."""

    trainer: list[str]
    engines: list[str]


def engines_first(cfg: FullyAsyncConfig, gpu: bool) -> bool:
    """Larger bundles first: Ray grants groups in order, and a small group placed first can take the node a TP bundle
    needed. The packing and the reservation take the same order."""
    return gpu and cfg.engine.tensor_parallel_size > cfg.trainer.n_gpus_per_node


def check_fit(cfg: FullyAsyncConfig, nodes: list[Node], gpu: bool) -> Assignment:
    """Raise PlacementError with the arithmetic when the run's groups cannot be packed onto `nodes` (best fit, the
    larger bundles first), in GPUs (gpu) and in logical CPUs (always: each trainer bundle holds one CPU per role, each
    engine bundle engine_server_cpus). Else the packing's node per group (in GPUs with gpu, else in CPUs): the
    targets `Placement.reserve` gives Ray, which has the last word. Nodes are taken in `cluster_nodes`' order
    whatever order they come in, so the same cluster always gives the same assignment."""
    tr, en = cfg.trainer, cfg.engine
    ordered = sorted(nodes, key=_node_order)
    roles = float(trainer_roles(cfg))
    dims = [("GPUs", "gpus", 1.0, float(en.tensor_parallel_size))] if gpu else []
    dims.append(("CPUs", "cpus", roles, engine_server_cpus(cfg, gpu)))
    assignment = None
    for unit, key, per_rank, per_server in dims:
        trainer = [tr.n_gpus_per_node * per_rank] * tr.nnodes if needs_trainer(cfg) else []
        engines = [per_server] * en.num_servers if needs_engines(cfg) else []
        problem, packed = _pack(ordered, key, trainer, engines, unit, engines_first(cfg, gpu))
        if problem is None:
            assignment = assignment or packed
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
    return assignment


def _node_order(node: Node) -> tuple:
    return (not node.driver, node.ip, node.node_id)


def _pack(nodes, key, trainer, engines, unit, engines_first) -> tuple[str | None, Assignment]:
    """Best-fit packing of the trainer groups (one node each) and the engine bundles (the engines first when
    `engines_first`), ties to the earlier node: the first that does not fit, in words (or None), and the node of
    each group placed."""
    free = {n.node_id: getattr(n, key) for n in nodes}
    placed = Assignment([], [])

    def place_trainer() -> str | None:
        for i, need in enumerate(trainer):
            # One trainer group per node, each on a node of its own (verl's process_on_nodes).
            fits = [n for n in nodes if n.node_id not in placed.trainer and free[n.node_id] >= need]
            if not fits:
                return f"no node left with {need:g} free {unit} for trainer node {i + 1} of {len(trainer)}"
            best = min(fits, key=lambda n: free[n.node_id])  # best fit: keep the big nodes for big TP bundles
            free[best.node_id] -= need
            placed.trainer.append(best.node_id)
        return None

    def place_engines() -> str | None:
        for i, need in enumerate(engines):
            fits = [n for n in nodes if free[n.node_id] >= need]
            if not fits:
                return f"no node has {need:g} free {unit} for engine server {i + 1} of {len(engines)}"
            best = min(fits, key=lambda n: free[n.node_id])
            free[best.node_id] -= need
            placed.engines.append(best.node_id)
        return None

    order = (place_engines, place_trainer) if engines_first else (place_trainer, place_engines)
    for place in order:
        if (problem := place()) is not None:
            return problem, placed
    return None, placed


def custom(resources: dict) -> dict[str, float]:
    """placement.*_resources as Ray bundle entries."""
    return {str(k): float(v) for k, v in resources.items()}


def engine_server_cpus(cfg: FullyAsyncConfig, gpu: bool) -> float:
    """Ray CPUs one engine server's bundle reserves: placement.engine_cpus, once per tensor-parallel rank without
    GPUs (each rank computes on cores of its own there: device.cpu_binding); with GPUs the ranks are its GPUs."""
    return cfg.placement.engine_cpus * (1 if gpu else cfg.engine.tensor_parallel_size)


def engine_bundle(cfg: FullyAsyncConfig, gpu: bool) -> dict[str, float]:
    """The one bundle an engine server reserves: its CPUs (engine_server_cpus), its tensor-parallel GPUs (gpu),
    custom resources."""
    bundle = {"CPU": engine_server_cpus(cfg, gpu)} | ({"GPU": float(cfg.engine.tensor_parallel_size)} if gpu else {})
    bundle = {k: v for k, v in bundle.items() if v > 0} | custom(cfg.placement.engine_resources)
    return bundle or {"CPU": 0.001}


# How long a group waits for its planned node before it may go elsewhere: the node is busy for a moment (a group
# just released is still being freed) far more often than it is taken by another job.
PIN_GRACE_S = 15.0


@dataclass(frozen=True)
class GroupSpec:
    """One placement group to ask for: its bundles and the node the packing gave it."""

    name: str
    bundles: list[dict[str, float]]
    target: str

    def create(self, pinned: bool) -> Any:
        """Pinned: only the target node will do (a label selector on the node id, a hard constraint); else the
        target is a hint Ray may override when the node has no room."""
        from ray.util.placement_group import placement_group

        name = f"{self.name}_{time.time_ns()}"
        bundles = [dict(b) for b in self.bundles]
        if pinned:
            selector = [{"ray.io/node-id": self.target} for _ in bundles]
            return placement_group(bundles, strategy="STRICT_PACK", name=name, bundle_label_selector=selector)
        return placement_group(bundles, strategy="STRICT_PACK", name=name, _soft_target_node_id=self.target)


def engine_groups(cfg: FullyAsyncConfig, gpu: bool, targets: list[str]) -> list[GroupSpec]:
    """One group (one bundle, engine_bundle) per engine server, each for its node in `targets`."""
    bundle = engine_bundle(cfg, gpu)
    return [GroupSpec(f"fully_async_engine_{i}", [bundle], targets[i]) for i in range(cfg.engine.num_servers)]


def trainer_groups(cfg: FullyAsyncConfig, gpu: bool, targets: list[str]) -> list[GroupSpec]:
    """One group per trainer node, one bundle per rank (its CPUs, its GPU, custom resources), each for its node in
    `targets`."""
    tr = cfg.trainer
    bundle = (
        {"CPU": float(trainer_roles(cfg))} | ({"GPU": 1.0} if gpu else {}) | custom(cfg.placement.trainer_resources)
    )
    return [GroupSpec(f"fully_async_trainer_{i}", [bundle] * tr.n_gpus_per_node, targets[i]) for i in range(tr.nnodes)]


def grant(specs: list[GroupSpec], timeout_s: float) -> tuple[list[Any], int]:
    """Ask Ray for every group in order, each pinned to its node for up to PIN_GRACE_S; a group still waiting then
    is asked again with its node as a hint only, until `timeout_s` in all. The groups (in `specs`' order) and how
    many Ray has granted; the caller removes them all when that is fewer than asked."""
    import ray
    from ray.util.placement_group import remove_placement_group

    deadline = time.monotonic() + timeout_s
    pgs: list[Any] = []
    try:
        pgs = [spec.create(pinned=True) for spec in specs]
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=min(PIN_GRACE_S, timeout_s))
        if len(ready) < len(pgs):
            for i, pg in enumerate(pgs):
                if not _granted(pg):
                    remove_placement_group(pg)
                    pgs[i] = specs[i].create(pinned=False)
            left = max(deadline - time.monotonic(), 0.0)
            ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=left)
    except BaseException:
        for pg in pgs:
            remove_placement_group(pg)
        raise
    return pgs, len(ready)


def _granted(pg: Any) -> bool:
    from ray.util.placement_group import placement_group_table

    return placement_group_table(pg).get("state") == "CREATED"


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
        nodes = cluster_nodes()
        gpu = uses_gpus(cfg, nodes)
        targets = check_fit(cfg, nodes, gpu)
        plan = cls(gpu, nodes)
        pl = cfg.placement
        try:
            first = engines_first(cfg, gpu)  # in the order check_fit packed them
            engines = engine_groups(cfg, gpu, targets.engines) if needs_engines(cfg) else []
            trainer = trainer_groups(cfg, gpu, targets.trainer) if needs_trainer(cfg) else []
            specs = engines + trainer if first else trainer + engines
            pgs, granted = grant(specs, pl.timeout_s) if specs else ([], 0)
            split = len(engines) if first else len(trainer)
            plan.engine_pgs, plan.trainer_pgs = (pgs[:split], pgs[split:]) if first else (pgs[split:], pgs[:split])
            if granted < len(specs):
                raise PlacementError(
                    f"Ray granted {granted} of {len(specs)} placement groups within placement.timeout_s="
                    f"{pl.timeout_s:g}s; the cluster's free resources changed, other jobs hold them, or no node "
                    f"declares the custom resources placement.engine_resources / trainer_resources ask for "
                    f"(ray status shows what is in use)"
                )
            plan.rows = granted_rows(cfg, plan)
            _warn_off_target(cfg, plan, targets)
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


def _warn_off_target(cfg: FullyAsyncConfig, plan: Placement, targets: Assignment) -> None:
    """One line per group Ray placed away from its target node (that node had no room for it when asked)."""
    import logging

    short = {n.node_id: n.short for n in plan.nodes}
    granted = Assignment(plan.trainer_nodes()[:: cfg.trainer.n_gpus_per_node], plan.engine_nodes())  # a group's rank 0
    for what, want, got in (("trainer node", targets.trainer, granted.trainer),
                            ("engine server", targets.engines, granted.engines)):  # fmt: skip
        for i, (w, g) in enumerate(zip(want, got)):
            if w != g:
                logging.getLogger(__name__).warning("placement: %s %d is on %s, not on %s as planned (no room there)",
                                                    what, i, short.get(g, g), short.get(w, w))  # fmt: skip


_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    import logging

    if message not in _LOGGED:
        _LOGGED.add(message)
        logging.getLogger(__name__).warning("%s", message)
