"""Engine hosts: one Ray actor per engine server, placed by Ray on the node (and GPUs) its placement-group bundle got.

The host owns the server process on its node: it picks a free port there, launches the server under the watchdog
(engines/process.py, so the server dies with the host however the host dies), binds it to an address the other
nodes can reach, answers health, liveness and log-tail questions, restarts and stops it. A server started through
a host inherits the host's environment, so it sees the CUDA_VISIBLE_DEVICES Ray gave the host's bundle.

`RemoteServer` is the host's stand-in in the Rollouter's process: it has the `ServerProcess` interface that
`EngineServers` drives (launch, wait_healthy, is_alive, stop, url, log_path), so the engine pool, the client and the
control plane stay the same whether a server is local or on another node.

Bind address (`engine.host`): "auto" = 127.0.0.1 when the server runs on the node of the process that talks to it
(the Rollouter), else the node's IP as Ray knows it; any other value is used as given. Off loopback, the server
requires the run's token (engines/auth.py).

Weights on other nodes (the disk transport, fully_async/weights/disk.py): when a server's node is not the trainer's,
one host per node (`write_weights`) writes each version's files, received through Ray's object store, under a
node-local root, and the server reloads from there; `remove_weights` deletes that root at the end of the run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from fully_async.engines.errors import EngineError
from fully_async.engines.process import ServerProcess, free_port, tail
from fully_async.handles import one_line

LOOPBACK = "127.0.0.1"

logger = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class EngineHost:
    """Ray actor (see the module docstring). Created by the job in a placement-group bundle; one server each."""

    def __init__(
        self,
        name: str,
        log_path: str,
        bind: str,
        client_node_id: str,
        cpu_set: list[int] | None = None,
        token: str | None = None,
    ):
        """`bind`: engine.host ("auto" or an address); `client_node_id`: the node of the process that sends the
        requests (the Rollouter), which decides "auto"; `cpu_set`: on a CPU host, the cores the server may use;
        `token`: the run's token (required by the auth proxy off loopback)."""
        import ray

        from fully_async.device import pin_all_threads
        from fully_async.engines.auth import TOKEN_ENV

        if token:
            os.environ[TOKEN_ENV] = token
        pin_all_threads(cpu_set)  # the server (a child) inherits the affinity
        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        if bind == "auto":
            bind = LOOPBACK if self.node_id == client_node_id else self.node_ip
        self.name, self.bind, self.log_path = name, bind, Path(log_path)
        self.proc: ServerProcess | None = None
        self.proxy = None
        self.weight_writes = 0
        """Versions this host wrote to its node's local weights root (one host per node writes)."""

    def where(self) -> dict[str, Any]:
        """Node, process and devices of this host (and of its server, when running): what the plan promised."""
        info = {
            "name": self.name,
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "host_pid": os.getpid(),
            "bind": self.bind,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "weight_writes": self.weight_writes,
        }
        if self.proc is not None and self.proc.popen is not None:
            info["server_pid"] = self.proc.popen.pid
            info["url"] = self.proc.url
            info["server_cuda_visible_devices"] = _environ(self.proc.popen.pid).get("CUDA_VISIBLE_DEVICES")
            info["server_ancestors"] = _ancestors(self.proc.popen.pid)
        return info

    def pick_ports(self) -> dict[str, Any]:
        """Where the next server listens: `url` (what clients use), `server_host` and `server_port` (the server's own
        bind). Off loopback the server binds 127.0.0.1 and the auth proxy listens on `url` (engines/auth.py)."""
        public = free_port(self.bind if self.bind not in ("0.0.0.0", "::") else "")
        node = {"node_id": self.node_id, "node_ip": self.node_ip}
        if is_loopback(self.bind):
            return {"url": f"http://{_url_host(self.bind, self.node_ip)}:{public}", "server_host": self.bind,
                    "server_port": public, **node}  # fmt: skip
        return {"url": f"http://{_url_host(self.bind, self.node_ip)}:{public}", "server_host": LOOPBACK,
                "server_port": free_port(LOOPBACK), "proxy_port": public, **node}  # fmt: skip

    def write_weights(self, name: str, version: int, files: list[tuple[str, list[Any]]]) -> str:
        """Write one weight version under this node's local root `name` (fully_async/weights/disk.py's
        write_node_copy: atomically, keeping it and the previous version); returns the version's directory, which
        the servers on this node reload. `files`: (relative path, chunks as ObjectRefs of uint8 arrays)."""
        import ray

        from fully_async.weights.disk import remove_dead_node_roots, write_node_copy

        if self.weight_writes == 0:
            # A new host, maybe replacing a lost node's: the copies this run left on this machine for lost nodes go.
            remove_dead_node_roots(name, {n["NodeID"] for n in ray.nodes() if n["Alive"]})
        out = write_node_copy(name, version, files, ray.get)
        self.weight_writes += 1
        return str(out)

    def remove_weights(self, name: str) -> None:
        """Delete this node's local weights root `name` (end of run)."""
        from fully_async.weights.disk import node_root

        shutil.rmtree(node_root(name), ignore_errors=True)

    def launch(self, command: list[str], env: dict[str, str], ports: dict[str, Any], health_path: str) -> str:
        """Start the server (stopping a previous one first) and, off loopback, its auth proxy; returns the URL
        clients use. Does not wait for health."""
        if self.proc is not None:
            self.proc.stop()
        self.proc = ServerProcess(
            name=self.name,
            command=lambda _port: command,
            env=env,
            log_path=self.log_path,
            host=ports["server_host"],
            health_path=health_path,
            port=ports["server_port"],
        )
        self.proc.launch()
        if "proxy_port" in ports and self.proxy is None:
            from fully_async.engines.auth import TOKEN_ENV, AuthProxy

            token = os.environ.get(TOKEN_ENV)
            if not token:
                self.proc.stop()
                raise RuntimeError(
                    f"{self.name}: engine server bound to {self.bind} (off loopback) needs the run's token in "
                    f"{TOKEN_ENV}; the job sets it"
                )
            self.proxy = AuthProxy(self.bind, ports["proxy_port"], self.proc.url, token)
        return ports["url"]

    def wait_healthy(self, timeout_s: float) -> None:
        self._proc().wait_healthy(timeout_s)

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc is not None:
            self.proc.stop(grace_s)
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None

    def tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)

    def _proc(self) -> ServerProcess:
        if self.proc is None:
            raise RuntimeError(f"{self.name}: no server launched on this host")
        return self.proc


class RemoteServer:
    """A server owned by an `EngineHost` actor, with the `ServerProcess` interface (see the module docstring).
    `command(port, host)` gives the server's command line for its own bind address and port."""

    launched = True

    def __init__(self, name: str, host: Any, command, env: dict[str, str], log_path: Path, health_path: str):
        self.name, self.host, self.command, self.env = name, host, command, env
        self.log_path, self.health_path = log_path, health_path
        self._ports: dict[str, Any] | None = None

    @property
    def node(self) -> dict[str, str]:
        """{"node_id", "node_ip"} of the host's node (known once `url` is)."""
        _ = self.url
        return {"node_id": self._ports["node_id"], "node_ip": self._ports["node_ip"]}

    @property
    def url(self) -> str:
        # Picked once and kept across restarts: the client's per-server bookkeeping stays valid.
        if self._ports is None:
            self._ports = self._get(self.host.pick_ports.remote())
        return self._ports["url"]

    def launch(self) -> None:
        _ = self.url
        ports = self._ports
        cmd = self.command(ports["server_port"], ports["server_host"])
        self._get(self.host.launch.remote(cmd, self.env, ports, self.health_path))

    def wait_healthy(self, timeout_s: float) -> None:
        import ray

        try:
            ray.get(self.host.wait_healthy.remote(timeout_s), timeout=timeout_s + 60)
        except ray.exceptions.RayTaskError as e:
            text = str(e.cause) if e.cause is not None else str(e)
            if "\x00" in text:
                # A message that is not text (seen once at a start-up, cause unknown): say where it came from instead.
                text = f"{self.name} at {self.url}: {type(e.cause).__name__} with a binary message {text[:120]!r}; {e}"
            raise EngineError(text) from None
        except ray.exceptions.RayError as e:
            raise EngineError(f"{self.name} at {self.url}: its engine host is gone ({type(e).__name__}: {e})") from e

    def is_alive(self) -> bool:
        """Asks the host (a blocking Ray call: the client asks from a thread, after a failed request)."""
        import ray

        try:
            return bool(ray.get(self.host.is_alive.remote(), timeout=30))
        except ray.exceptions.RayError:
            return False  # the host (or its node) is gone: so is the server

    def stop(self, grace_s: float = 15.0) -> None:
        import ray

        # A host that is gone took its server with it (the watchdog's lifeline closed).
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(self.host.stop.remote(grace_s), timeout=grace_s + 30)

    def host_answers(self, timeout_s: float) -> bool | None:
        """Whether the engine host actor answers within `timeout_s`: True; False when it (or its node) is reported
        gone; None when it says nothing in time (a hung node or host: engines/hung.py waits it out)."""
        import ray

        try:
            ray.get(self.host.where.remote(), timeout=timeout_s)
            return True
        except ray.exceptions.GetTimeoutError:
            return None
        except ray.exceptions.RayError:
            return False

    def tail(self, lines: int = 40) -> str:
        import ray

        try:
            return ray.get(self.host.tail.remote(lines), timeout=30)
        except ray.exceptions.RayError as e:
            return f"(no log: the engine host is gone: {type(e).__name__})"

    @staticmethod
    def _get(ref):
        import ray

        return ray.get(ref, timeout=120)


def stop_hosts(hosts: list[Any], timeout_s: float) -> None:
    """Stop the servers of `hosts` (EngineHost handles) at once and wait up to `timeout_s`. A host already gone (its
    node lost: its server died with it) and one whose stop fails are one line each, without Ray's traceback; the
    others are stopped all the same."""
    import ray

    refs = [h.stop.remote() for h in hosts]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for index, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError as e:
            logger.warning("engine host %d: gone already (%s); its server went with it", index, type(e).__name__)
        except Exception as e:  # the other hosts are stopped all the same; this one is reported
            logger.warning("engine host %d: stop failed: %s", index, one_line(e))


class HostFactory:
    """Creates the engine hosts of one run: the job's first ones in the groups its plan reserved, and later ones
    (servers added, or replacing a server whose node is gone) each in a new one-bundle placement group on whatever node
    has room, within placement.timeout_s. Lives in the job's driver, then travels to the Rollouter, which grows and
    heals the pool. Groups it reserved itself are removed by `release_slot` / `close`; the plan's own by the job."""

    def __init__(self, cfg: Any, run_dir: str, client_node_id: str, cpu_set: list[int] | None, token: str | None,
                 gpu: bool, groups: list[Any] | None = None):  # fmt: skip
        from fully_async.placement import engine_bundle

        en, pl = cfg.engine, cfg.placement
        self.kind, self.bind, self.tp = en.kind, en.host, en.tensor_parallel_size
        self.run_dir, self.client_node_id, self.cpu_set, self.token = run_dir, client_node_id, cpu_set, token
        self.gpu, self.cpus, self.timeout_s = gpu, pl.engine_cpus, pl.timeout_s
        self.bundle = engine_bundle(cfg, gpu)
        self.groups: dict[int, Any] = dict(enumerate(groups or []))
        self._own: dict[int, Any] = {}

    def spawn(self, index: int, group: Any) -> Any:
        """An EngineHost actor for server `index` in `group`'s only bundle."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options: dict[str, Any] = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
            "num_cpus": self.cpus,
            "max_concurrency": 8,  # a health wait must not block is_alive() or tail()
            "runtime_env": {"env_vars": {"RAY_worker_niceness": "0"}},
        }
        if self.gpu:
            options["num_gpus"] = self.tp
        log_path = Path(self.run_dir) / "engines" / f"{self.kind}-{index}.log"
        return (
            ray.remote(EngineHost)
            .options(**options)
            .remote(f"{self.kind}-{index}", str(log_path), self.bind, self.client_node_id, self.cpu_set, self.token)
        )

    def create(self, index: int, avoid_node: str | None = None) -> Any:
        """A host for server `index` in a new placement group (the slot's old group, if any, removed first: a lost
        node's group would otherwise hold the resources the replacement needs). Blocks until Ray grants it.
        `avoid_node`: a node that hangs while Ray still reports it alive (its resources look free): the group goes
        to another node, when the cluster has another one alive."""
        import ray
        from ray.util.placement_group import placement_group

        from fully_async.placement import PlacementError

        self.release_slot(index)
        bundle = dict(self.bundle)
        selector = None
        if avoid_node is not None and any(n["Alive"] and n["NodeID"] != avoid_node for n in ray.nodes()):
            selector = [{"ray.io/node-id": f"!{avoid_node}"}]  # Ray's label selector: any node but that one
        group = placement_group([bundle], strategy="STRICT_PACK", name=f"fully_async_engine_{index}_{time.time_ns()}",
                                bundle_label_selector=selector)  # fmt: skip
        ready, _ = ray.wait([group.ready()], timeout=self.timeout_s)
        if not ready:
            _remove(group)
            raise PlacementError(
                f"no node had room for engine server {index} ({bundle}) within placement.timeout_s={self.timeout_s:g}s"
            )
        self.groups[index] = self._own[index] = group
        return self.spawn(index, group)

    @staticmethod
    def release(host: Any) -> None:
        """Kill an engine host (its server dies with it through the watchdog's lifeline)."""
        import ray

        with contextlib.suppress(Exception):
            ray.kill(host, no_restart=True)

    def release_slot(self, index: int) -> None:
        group = self.groups.pop(index, None)
        self._own.pop(index, None)
        if group is not None:
            _remove(group)

    def close(self) -> None:
        """Remove the groups this factory reserved itself. Idempotent."""
        for index in list(self._own):
            self.release_slot(index)


def _remove(group: Any) -> None:
    from ray.util.placement_group import remove_placement_group

    with contextlib.suppress(Exception):  # already removed, or Ray gone at shutdown
        remove_placement_group(group)


def _url_host(bind: str, node_ip: str) -> str:
    host = node_ip if bind in ("0.0.0.0", "::") else bind
    return f"[{host}]" if ":" in host else host


def _environ(pid: int) -> dict[str, str]:
    """The environment a live process started with (empty when it is gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def _ancestors(pid: int) -> list[list]:
    """[pid, command name] from `pid`'s parent up to init: shows which raylet (node) a server runs under."""
    chain = []
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        try:
            with open(f"/proc/{pid}/comm") as f:
                chain.append([pid, f.read().strip()])
        except OSError:
            break
    return chain
