"""The engine pool composed, not inherited: a kind is an adapter the pool holds, and each room that works on the pool
(control, elastic, recovery, adapters, warm-up, lifecycle) reads only what its Protocol names, which the pool satisfies."""

from __future__ import annotations

import ast
import inspect

import pytest

from fully_async.config import EngineConfig
from fully_async.engines import adapters, build_engine, control, elastic, lifecycle, recovery, warmup
from fully_async.engines.base import EngineKind
from fully_async.engines.pool import EngineServers
from fully_async.engines.sglang import SGLangKind
from fully_async.engines.sim import SimKind
from fully_async.engines.vllm import VLLMKind
from tests.fakes import FakeProcessServers

ROOMS = [
    (control, control.ControlledPool, "pool"),
    (elastic, elastic.ElasticPool, "pool"),
    (recovery, recovery.RecoveredPool, "servers"),
    (adapters, adapters.AdaptedPool, "pool"),
    (warmup, warmup.WarmedPool, "pool"),
    (lifecycle, lifecycle.LifecyclePool, "pool"),
]


def _members(protocol: type) -> set[str]:
    names = set(getattr(protocol, "__annotations__", {}))
    return names | {n for n in vars(protocol) if not n.startswith("_")}


def _pool_reads(module, var: str) -> set[str]:
    """Every attribute the module's code reads on `var` or `self.<var>` (the pool it was handed)."""
    reads = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if not isinstance(node, ast.Attribute):
            continue
        if ast.unparse(node.value) in (var, f"self.{var}"):
            reads.add(node.attr)
    return reads


@pytest.mark.parametrize(("module", "protocol", "var"), ROOMS, ids=[r[0].__name__.rsplit(".", 1)[1] for r in ROOMS])
def test_each_room_reads_only_what_its_protocol_names(module, protocol, var):
    reads = _pool_reads(module, var)
    assert reads, f"{module.__name__} reads nothing of its pool: the scan looks at the wrong name"
    assert reads <= _members(protocol), f"{module.__name__} reads {sorted(reads - _members(protocol))} of the pool"


def test_the_pool_satisfies_every_room_protocol(tmp_path):
    sim = build_engine(EngineConfig(kind="sim", num_servers=2), tmp_path, tmp_path)
    processes = FakeProcessServers(EngineConfig(), tmp_path, tmp_path)
    for pool in (sim, processes):
        for _, protocol, _ in ROOMS:
            assert isinstance(pool, protocol), f"{type(pool).__name__} lacks a member of {protocol.__name__}"


def test_a_kind_is_held_by_the_pool_not_inherited(tmp_path):
    assert not issubclass(EngineServers, EngineKind)
    for kind in (VLLMKind, SGLangKind, SimKind):
        assert issubclass(kind, EngineKind) and not issubclass(kind, EngineServers)
    pool = build_engine(EngineConfig(kind="sim", num_servers=2), tmp_path, tmp_path)
    assert isinstance(pool.kind, SimKind) and pool.kind.name == "sim" and pool.cfg is pool.kind.cfg
