"""The placement arithmetic (fully_async/placement.py check_fit) on described clusters; Ray's own placement of the
same plans is checked on a real 2-node cluster in tests/integration/test_cluster_job.py."""

from __future__ import annotations

import pytest

from fully_async.config import compose
from fully_async.placement import Assignment, Node, PlacementError, check_fit, uses_gpus


def _cfg(*overrides: str):
    return compose(list(overrides))


def _nodes(*gpus: float, cpus: float = 16) -> list[Node]:
    return [Node(f"node{i:02d}" + "0" * 30, f"10.0.0.{i + 1}", cpus, g, driver=i == 0) for i, g in enumerate(gpus)]


def test_two_8_gpu_nodes_hold_trainer_8_and_engines_4_x_tp2():
    cfg = _cfg("trainer.nnodes=1", "trainer.n_gpus_per_node=8", "engine.num_servers=4", "engine.tensor_parallel_size=2")
    nodes = _nodes(8, 8)
    plan = check_fit(cfg, nodes, gpu=True)
    # The trainer fills one node; the four TP-2 servers (8 GPUs) fill the other, each bundle whole on it.
    (trainer,) = plan.trainer
    assert trainer in {n.node_id for n in nodes} and len(plan.engines) == 4
    assert set(plan.engines) == {n.node_id for n in nodes} - {trainer}


def test_not_enough_gpus_gives_the_arithmetic():
    cfg = _cfg("trainer.n_gpus_per_node=8", "engine.num_servers=2", "engine.tensor_parallel_size=2")
    with pytest.raises(PlacementError) as e:
        check_fit(cfg, _nodes(8), gpu=True)
    msg = str(e.value)
    assert "needs 12 GPUs" in msg and "trainer 8 (1 x 8)" in msg and "engines 2 x 2 = 4" in msg, msg
    assert "cluster has 8 GPUs on 1 node" in msg, msg
    assert "engine server 1 of 2" in msg, msg


def test_enough_gpus_in_total_but_a_tp_bundle_cannot_span_nodes():
    # 3 + 3 free GPUs after nothing else: a TP-4 server needs 4 on ONE node.
    cfg = _cfg("engine.num_servers=1", "engine.tensor_parallel_size=4", "trainer.n_gpus_per_node=2")
    with pytest.raises(PlacementError, match="no node has 4 free GPUs for engine server 1 of 1"):
        check_fit(cfg, _nodes(0, 3, 3), gpu=True)
    check_fit(cfg, _nodes(0, 2, 4), gpu=True)


def test_trainer_nodes_are_distinct_nodes():
    # Two trainer nodes of 4 ranks: one 8-GPU node is not two nodes.
    cfg = _cfg("trainer.nnodes=2", "trainer.n_gpus_per_node=4", "engine.num_servers=1")
    with pytest.raises(PlacementError, match="trainer node 2 of 2"):
        check_fit(cfg, _nodes(9), gpu=True)
    check_fit(cfg, _nodes(4, 5), gpu=True)


def test_trainer_and_engine_gpus_are_counted_once():
    # 4 GPUs: trainer 2 + engines 2 x 1 fits exactly; one more engine does not (GPUs are not shared).
    check_fit(_cfg("trainer.n_gpus_per_node=2", "engine.num_servers=2"), _nodes(0, 4), gpu=True)
    with pytest.raises(PlacementError, match="needs 5 GPUs"):
        check_fit(_cfg("trainer.n_gpus_per_node=2", "engine.num_servers=3"), _nodes(0, 4), gpu=True)


def test_cpu_mode_counts_logical_cpus_and_the_reference_ranks():
    cfg = _cfg("algorithm.use_kl_loss=true", "engine.num_servers=1")
    check_fit(cfg, _nodes(0, cpus=3), gpu=False)
    with pytest.raises(PlacementError, match=r"needs 3 CPUs: trainer 2 \(1 x 1 x 2\), engines 1 x 1 = 1"):
        check_fit(cfg, _nodes(0, cpus=2), gpu=False)


def test_cpu_mode_counts_the_critic_ranks_too():
    cfg = _cfg("algorithm.use_kl_loss=true", "algorithm.adv_estimator=gae", "engine.num_servers=1")
    check_fit(cfg, _nodes(0, cpus=4), gpu=False)
    with pytest.raises(PlacementError, match=r"needs 4 CPUs: trainer 3 \(1 x 1 x 3\)"):
        check_fit(cfg, _nodes(0, cpus=3), gpu=False)


def test_sim_engines_and_trainer_reserve_nothing():
    # 64 emulated engines fit on one CPU: no group is planned for them or for the sim trainer.
    plan = check_fit(_cfg("engine=sim", "trainer=sim", "engine.num_servers=64"), _nodes(0, cpus=1), gpu=False)
    assert plan == Assignment(trainer=[], engines=[])


def test_resources_auto_follows_the_cluster():
    cfg = _cfg()
    assert uses_gpus(cfg, _nodes(0, 4)) and not uses_gpus(cfg, _nodes(0, 0))
    assert not uses_gpus(_cfg("placement.resources=cpu"), _nodes(0, 4))
    assert uses_gpus(_cfg("placement.resources=gpu"), _nodes(0))


def test_gpu_runs_also_need_the_logical_cpus_of_their_bundles():
    # 8 trainer ranks take one CPU each: a GPU node that declares 4 CPUs cannot hold them.
    cfg = _cfg("trainer.n_gpus_per_node=8", "engine.num_servers=4", "engine.tensor_parallel_size=2")
    with pytest.raises(
        PlacementError, match=r"needs 12 CPUs: trainer 8 \(1 x 8\), engines 4 x 1 = 4; .*more --num-cpus"
    ):
        check_fit(cfg, _nodes(0, 8, 8, cpus=4), gpu=True)
    check_fit(cfg, _nodes(0, 8, 8, cpus=8), gpu=True)


def test_the_assignment_is_the_same_whatever_order_the_nodes_come_in():
    """`--plan` and the job each reserve on their own: both aim every group at the node this packing gives, so the
    plan a user reads maps the same servers to the same nodes as the job (Ray alone swapped equal nodes)."""
    # Two equal nodes, one engine server on each (5 + 5 logical CPUs do not fit one node of 8).
    cfg = _cfg("placement.resources=cpu", "trainer=sim", "engine.num_servers=2", "placement.engine_cpus=5")
    nodes = _nodes(0, 0, cpus=8)
    driver, worker = nodes[0].node_id, nodes[1].node_id
    for order in (nodes, nodes[::-1]):
        assert check_fit(cfg, order, gpu=False) == Assignment(trainer=[], engines=[driver, worker])
    # The GPU example's shape: trainer 8 on one node, engines 4 x TP 2 on the other; a node without GPUs gets none.
    cfg = _cfg("trainer.n_gpus_per_node=8", "engine.num_servers=4", "engine.tensor_parallel_size=2")
    nodes = _nodes(0, 8, 8)
    for order in (nodes, nodes[::-1], [nodes[1], nodes[0], nodes[2]]):
        assert check_fit(cfg, order, gpu=True) == Assignment([nodes[1].node_id], [nodes[2].node_id] * 4)


def test_tp_bundles_larger_than_a_trainer_node_are_packed_first_as_they_are_reserved():
    # Trainer first would put its 2 ranks on the 4-GPU node (best fit) and the TP-4 server on the 6-GPU one; Ray is
    # asked for the TP-4 group first (Placement.reserve), and the packing goes in the same order.
    cfg = _cfg("trainer.n_gpus_per_node=2", "engine.num_servers=1", "engine.tensor_parallel_size=4")
    nodes = _nodes(0, 4, 6)
    assert check_fit(cfg, nodes, gpu=True) == Assignment([nodes[2].node_id], [nodes[1].node_id])


def test_a_group_is_pinned_to_its_node_and_falls_back_to_a_hint_after_the_grace(ray_local, monkeypatch):
    """Pinned first (Ray must honour it); a group whose node cannot take it (here: no such node) is asked again
    after PIN_GRACE_S with the node as a hint only, and Ray places it where there is room."""
    import time

    from ray.util.placement_group import placement_group_table, remove_placement_group

    from fully_async import placement

    here = ray_local.get_runtime_context().get_node_id()
    absent = "ab" * 28
    monkeypatch.setattr(placement, "PIN_GRACE_S", 1.0)
    specs = [
        placement.GroupSpec("t_here", [{"CPU": 1.0}], here),
        placement.GroupSpec("t_absent", [{"CPU": 1.0}], absent),
    ]
    t0 = time.monotonic()
    pgs, granted = placement.grant(specs, timeout_s=30)
    try:
        assert granted == 2
        assert time.monotonic() - t0 >= 1.0  # the absent node's group waited out the grace before its fallback
        nodes = [placement_group_table(pg)["bundles_to_node_id"][0] for pg in pgs]
        assert nodes == [here, here]
    finally:
        for pg in pgs:
            remove_placement_group(pg)


def test_a_group_that_fits_nowhere_is_reported_not_granted(ray_local, monkeypatch):
    from fully_async import placement

    monkeypatch.setattr(placement, "PIN_GRACE_S", 0.5)
    here = ray_local.get_runtime_context().get_node_id()
    pgs, granted = placement.grant([placement.GroupSpec("t_huge", [{"CPU": 1000.0}], here)], timeout_s=2)
    assert granted == 0 and len(pgs) == 1
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(pgs[0])


def test_a_cpu_tp_server_reserves_a_cpu_per_rank_and_a_gpu_one_its_gpus():
    from fully_async.placement import engine_bundle

    cfg = _cfg("placement.resources=cpu", "trainer=sim", "engine.tensor_parallel_size=2")
    assert engine_bundle(cfg, gpu=False) == {"CPU": 2.0}  # each rank computes on cores of its own
    assert engine_bundle(cfg, gpu=True) == {"CPU": 1.0, "GPU": 2.0}  # the ranks are the GPUs
    check_fit(cfg, _nodes(0, cpus=2), gpu=False)
    with pytest.raises(PlacementError, match=r"needs 2 CPUs: engines 1 x 2 = 2; cluster has 1 CPUs"):
        check_fit(cfg, _nodes(0, cpus=1), gpu=False)
