"""The engine port: what the weight transports (and `python -m fully_async.ctl engines`) may ask of the engine pool a
Rollouter runs, one typed method per call.

The Rollouter actor answers every call through one actor method, `Rollouter.engine(call, *args)`, with the method of
the same name of its `EngineService` (fully_async/engines/service.py, where what each call does is written).
`EnginePort` is the asking side, over the Rollouter's actor handle: each of its methods is one
`rollouter.engine.remote(<its name>, <its arguments>)` actor call, handed back in flight (`InFlight`: a Ray
ObjectRef, or a LocalActor future where a test runs the roles in one process; `fully_async.handles.resolve` gives
its value). So calls run in the order they are sent (one actor) and the caller chooses when to wait: the collective
transport sends one `rpc` per server and waits for them together.

Contracts:
- The methods of `EnginePort` are the port's one list of calls (`CALLS`): EngineService answers these and no
  others, each with the same parameters (tests/unit/weights/test_port.py holds the two sides together), so a call
  renamed on one side fails that test, and a transport asking for a call that does not exist fails with an
  AttributeError in its own process instead of a refusal inside the actor.
- Arguments are checked against the method's signature before anything is sent (a TypeError in the caller) and
  sent positionally, defaults filled in (the actor method takes `*args`).

It lives beside the transports that ask through it, so that the weight package needs nothing of the engine package
(engines/ sits above weights/ in the import layers); the engine package answers it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T", covariant=True)


class InFlight(Protocol[T]):
    """An engine port call in flight whose value is a T: a Ray ObjectRef (a LocalActor future without Ray), for
    `fully_async.handles.resolve`, `ray.get` or `ray.wait`."""


def _call(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` (its signature and docstring; no body) as one engine port call of its own name."""
    name, signature = method.__name__, inspect.signature(method)

    @functools.wraps(method)
    def send(self: EnginePort, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        return self.rollouter.engine.remote(name, *bound.args[1:])

    send.port_call = name  # type: ignore[attr-defined]
    return send


class EnginePort:
    """The engine port of one Rollouter: `rollouter` is its actor handle (anything with `engine.remote(call, *args)`).
    Each method returns the call in flight; its docstring says the value."""

    def __init__(self, rollouter: Any) -> None:
        self.rollouter = rollouter

    # ---- what a transport reads --------------------------------------------------------------------------------------
    @_call
    def nodes(self) -> InFlight[list[dict[str, Any]]]:
        """Per engine server in the pool and not down: {"node_id", "node_ip", "host"} (where the disk transport
        copies the weights)."""

    @_call
    def layout(self) -> InFlight[dict[str, Any]]:
        """The weight group's epoch (the pool's `weights.epoch`) and the servers a weight group spans now, each with its
        index, URL and worker count."""

    @_call
    def rpc(self, index: int, method: str, spec: str, timeout_s: float) -> InFlight[list[Any]]:
        """The weight receiver's `method(spec)` (a JSON string) on every worker of server `index`: their answers."""

    @_call
    def rpc_all(self, method: str, spec: str) -> InFlight[dict[str, Any] | None]:
        """The worker extension's `method(spec)` on every serving server at once: {url: the workers' answers, or why
        the server gave none}; None when the engine kind has no worker extension."""

    @_call
    def unverifiable(self) -> InFlight[str]:
        """Why syncs into these engines cannot be proven by a digest ("" = they can)."""

    @_call
    def control_deadline_s(self) -> InFlight[float]:
        """engine.control_deadline_s."""

    # ---- a sync's steps ----------------------------------------------------------------------------------------------
    @_call
    def load_weights(
        self, weights_dir: str, version: int, node_dirs: dict[str, str | None] | None = None
    ) -> InFlight[dict[str, Any] | None]:
        """Every engine reloads `weights_dir` (or its node's copy in `node_dirs`) as `version`, between the
        Rollouter's pause and resume: the servers' answers to the reload."""

    @_call
    def weights_received(self, version: int, epoch: int) -> InFlight[None]:
        """Every server holds `version` (sent through the weight group formed at `epoch`): label it, no reload."""

    @_call
    def load_adapter(self, name: str, path: str, node_dirs: dict[str, str | None] | None = None) -> InFlight[None]:
        """Every engine loads the LoRA adapter in `path` (or its node's copy) as `name`."""

    @_call
    def activate_adapter(self, name: str, version: int) -> InFlight[None]:
        """New requests name adapter `name`: the engines serve `version` from now on."""

    @_call
    def unload_adapters(self) -> InFlight[dict[str, list[str]]]:
        """Unload the adapters no request names any more: {"loaded": the names still loaded, ...}."""

    # ---- fully_async.ctl engines -------------------------------------------------------------------------------------
    @_call
    def rows(self) -> InFlight[list[dict[str, Any]]]:
        """One row per server slot (index, url, state, in_flight, busy_s, node_id): `fully_async.ctl engines --list`."""

    @_call
    def add(self, count: int = 1, max_servers: int | None = None) -> InFlight[dict[str, Any]]:
        """Start `count` more engine servers (refused past `max_servers`, default engine.max_servers):
        {"joined", "seconds", "live"}."""

    @_call
    def remove(
        self, url: str, min_servers: int | None = None, drain_timeout_s: float | None = None
    ) -> InFlight[dict[str, Any]]:
        """Take the server at `url` out of the pool (refused below `min_servers`, default engine.min_servers):
        {"removed", "moved", "live"}."""


CALLS = frozenset(name for name, member in vars(EnginePort).items() if getattr(member, "port_call", None) == name)
"""The engine port's calls: the names of EnginePort's methods, the one list that EngineService answers."""
