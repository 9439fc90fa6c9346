"""The verl backend with real Ray workers on CPU (gloo): world-size and micro-batch invariance, decoupled PPO,
weight export, checkpoints, learning. Two backends (1 and 2 ranks) serve the whole module; each test starts from
the initial checkpoint so tests are independent."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fully_async.config import AlgorithmConfig, TinyModelConfig, TrainerConfig
from fully_async.protocol import flatten
from tests.training_data import hf_log_probs, load_hf_model, make_groups

TEMPERATURE = 0.9


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from fully_async.models.tiny import build_tiny_model

    return build_tiny_model(
        TinyModelConfig(hidden_size=64, intermediate_size=128), cache_dir=tmp_path_factory.mktemp("m")
    )


def _backend(ray_local, model, world_size, tmp, **algo):
    from fully_async.training import build_backend

    trainer = TrainerConfig(n_gpus_per_node=world_size, max_token_len_per_gpu=512, total_steps=20)
    be = build_backend(trainer, AlgorithmConfig(**algo), model, temperature=TEMPERATURE, device="cpu")
    be.save_checkpoint(tmp / "init", 0)
    be.fa_init = tmp / "init"
    return be


@pytest.fixture(scope="module")
def be1(ray_local, tiny_model, tmp_path_factory):
    be = _backend(ray_local, tiny_model, 1, tmp_path_factory.mktemp("ws1"))
    yield be
    be.shutdown()


@pytest.fixture(scope="module")
def be2(ray_local, tiny_model, tmp_path_factory):
    be = _backend(ray_local, tiny_model, 2, tmp_path_factory.mktemp("ws2"))
    yield be
    be.shutdown()


def _reset(be, **algo):
    be.load_checkpoint(be.fa_init)
    be.set_algorithm(AlgorithmConfig(**algo))
    be.trainer = dataclasses.replace(be.trainer, max_token_len_per_gpu=512)


def _weights(be, out, export: bool = True):
    """The tensors of an export into `out` (`export=False`: of the one already there)."""
    if export:
        be.export_weights(out)
    tensors = {}
    for f in sorted(out.glob("model-*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def _assert_same_weights(a, b, atol=2e-5):
    """Adam's first step is lr * g / (|g| + eps): a gradient entry near 0 turns float32 summation-order noise into
    up to ~1e-5 of weight change, so weights are compared at 2% of lr. The loss and the (pre-clip) grad norm are the
    scale-sensitive checks."""
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_world_size_2_matches_world_size_1(be1, be2, tmp_path):
    assert be1.world_size == 1 and be2.world_size == 2
    # fsdp_units=auto: the one CPU rank shards the model as one unit, two ranks per layer; same update either way.
    (units1,) = {i["fsdp_units"] for i in be1.ranks.call_all("policy", "rank_info")}
    (units2,) = {i["fsdp_units"] for i in be2.ranks.call_all("policy", "rank_info")}
    assert units2 - units1 == TinyModelConfig().num_layers
    groups = make_groups(3, 3, seed=11)  # 9 trajectories: not divisible by 2 ranks
    _reset(be1)
    _reset(be2)
    m1, m2 = be1.update(groups), be2.update(groups)
    assert m1["actor/loss"] == pytest.approx(m2["actor/loss"], rel=1e-5, abs=1e-7)
    assert m1["actor/grad_norm"] == pytest.approx(m2["actor/grad_norm"], rel=1e-5)
    _assert_same_weights(_weights(be1, tmp_path / "w1"), _weights(be2, tmp_path / "w2"))


def test_uneven_batches_with_several_mini_batches(be2):
    _reset(be2)
    be2.trainer = dataclasses.replace(be2.trainer, num_mini_batches=4)
    try:
        for num_groups, n in [(1, 1), (1, 3), (5, 1)]:  # fewer rows than ranks x mini-batches, odd sizes
            m = be2.update(make_groups(num_groups, n, seed=num_groups))
            assert np.isfinite(m["actor/loss"]) and np.isfinite(m["actor/grad_norm"])
    finally:
        be2.trainer = dataclasses.replace(be2.trainer, num_mini_batches=1)


def test_micro_batch_token_budget_does_not_change_the_update(be1, tmp_path):
    groups = make_groups(4, 2, seed=5)
    longest = max(len(t.prompt_ids) + len(t.response_ids) for t in flatten(groups))
    results = []
    for budget in (512, longest):  # one micro-batch vs about one sequence per micro-batch
        _reset(be1)
        be1.trainer = dataclasses.replace(be1.trainer, max_token_len_per_gpu=budget)
        m = be1.update(groups)
        results.append((m, _weights(be1, tmp_path / f"b{budget}")))
    (ma, wa), (mb, wb) = results
    assert ma["actor/loss"] == pytest.approx(mb["actor/loss"], rel=1e-5, abs=1e-7)
    assert ma["actor/grad_norm"] == pytest.approx(mb["actor/grad_norm"], rel=1e-5)
    _assert_same_weights(wa, wb)


def test_budget_smaller_than_a_sequence_is_a_clear_error(be1):
    _reset(be1)
    be1.trainer = dataclasses.replace(be1.trainer, max_token_len_per_gpu=3)
    with pytest.raises(ValueError, match="max_token_len_per_gpu"):
        be1.compute_log_probs(make_groups(1, 1, prompt_len=(4, 4)))


def _on_policy(be, groups):
    """Set each trajectory's behaviour log-probs to the trainer's own (as an exact engine would report)."""
    for t, lp in zip(flatten(groups), be.compute_log_probs(groups), strict=True):
        t.behaviour_logprobs = lp.astype(np.float32)
    return groups


def test_decoupled_ppo_equals_bypass_when_behaviour_is_proximal(be1, tmp_path):
    _reset(be1)
    groups = _on_policy(be1, make_groups(3, 2, seed=7))
    weights = []
    for recompute in (True, False):
        _reset(be1, recompute_prox=recompute)
        m = be1.update(groups)
        if recompute:
            assert m["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-5)
        weights.append(_weights(be1, tmp_path / str(recompute)))
    _assert_same_weights(*weights)


def _assert_hf_log_probs(model_dir, groups, want):
    """The Hugging Face model in `model_dir`, loaded by transformers, gives the log-probs `want` on `groups`."""
    for lp, lp_want in zip(hf_log_probs(load_hf_model(model_dir), groups, TEMPERATURE), want, strict=True):
        np.testing.assert_allclose(lp, lp_want, atol=1e-5)


def test_exported_weights_reload_with_identical_log_probs(be1, tmp_path):
    _reset(be1)
    groups = make_groups(2, 2, seed=3)
    be1.update(groups)  # export trained weights, not the initial ones
    files = be1.export_weights(tmp_path / "export")
    assert files and (tmp_path / "export" / "config.json").exists()
    _assert_hf_log_probs(tmp_path / "export", groups, be1.compute_log_probs(groups))


def test_a_checkpoint_resumes_at_another_world_size(be1, be2, tmp_path):
    """1 rank writes, 2 ranks load (model and Adam moments resharded, LR schedule carried): the next update is the
    one the writer would have made. A fresh optimizer or schedule would move the weights by ~lr, not ~1e-5."""
    _reset(be1)
    _reset(be2)
    g1, g2 = make_groups(2, 2, seed=31), make_groups(3, 3, seed=32)
    be1.update(g1)
    be1.update(g1)
    be1.save_checkpoint(tmp_path / "ck", 2)
    ma = be1.update(g2)
    assert be2.load_checkpoint(tmp_path / "ck") == 2
    # the schedule's position (the LR is constant here, so the update alone would not show a schedule left behind)
    assert {i["lr_scheduler_steps"] for i in be2.ranks.call_all("policy", "rank_info")} == {2}
    mb = be2.update(g2)
    assert ma["actor/loss"] == pytest.approx(mb["actor/loss"], rel=1e-5, abs=1e-7)
    assert ma["actor/grad_norm"] == pytest.approx(mb["actor/grad_norm"], rel=1e-5)
    assert ma["actor/lr"] == mb["actor/lr"]
    _assert_same_weights(_weights(be1, tmp_path / "a"), _weights(be2, tmp_path / "b"))


def test_export_cli_joins_a_two_rank_checkpoint_into_a_loadable_model(be2, tiny_model, tmp_path, capsys):
    from fully_async.export import main

    _reset(be2)
    groups = make_groups(2, 2, seed=5)
    be2.update(groups)
    ckpt = tmp_path / "run" / "checkpoints" / "step_1"
    be2.save_checkpoint(ckpt / "backend", 1)
    (ckpt / "state.json").write_text(json.dumps({"config": {"model": {"path": str(tiny_model)}}}))
    (ckpt.parent / "latest").write_text("step_1")
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    assert "model_world_size_2_rank_1.pt" in capsys.readouterr().out  # progress names each shard it reads
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).is_file(), name
    _assert_hf_log_probs(tmp_path / "hf", groups, be2.compute_log_probs(groups))


def test_export_casts_to_the_engine_dtype(be1, tmp_path):
    _reset(be1)
    be1.export_weights(tmp_path / "bf16", dtype="bfloat16")
    tensors = load_file(next((tmp_path / "bf16").glob("model-*.safetensors")))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


def test_checkpoint_round_trip_resumes_identically(be1, tmp_path):
    _reset(be1)
    g1, g2 = make_groups(2, 2, seed=21), make_groups(2, 2, seed=22)
    be1.update(g1)
    be1.save_checkpoint(tmp_path / "ck", 1)
    ma = be1.update(g2)
    wa = _weights(be1, tmp_path / "a")
    assert be1.load_checkpoint(tmp_path / "ck") == 1
    mb = be1.update(g2)
    wb = _weights(be1, tmp_path / "b")
    assert ma["actor/loss"] == mb["actor/loss"] and ma["actor/grad_norm"] == mb["actor/grad_norm"]
    _assert_same_weights(wa, wb, atol=0)


def test_repeated_updates_raise_the_log_prob_of_rewarded_responses(be1):
    _reset(be1)
    groups = _on_policy(be1, make_groups(3, 2, seed=9))  # sample 1 of each group has reward 1, sample 0 reward 0

    def rewarded_minus_unrewarded():
        lps = be1.compute_log_probs(groups)
        s = [float(lp.sum()) for lp in lps]
        return sum(s[1::2]) - sum(s[0::2])

    before = rewarded_minus_unrewarded()
    for _ in range(5):
        be1.update(groups)
    after = rewarded_minus_unrewarded()
    assert after > before + 0.5, (before, after)


def test_reference_model_and_kl_loss(ray_local, tiny_model, tmp_path):
    """Needs patches/0002 on CPU (a forward-only FSDP engine otherwise pins memory and fails)."""
    from fully_async.training import build_backend

    trainer = TrainerConfig(max_token_len_per_gpu=512, total_steps=20)
    algo = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.5, entropy_coeff=0.01)
    cpus_before = ray_local.available_resources()["CPU"]
    be = build_backend(trainer, algo, tiny_model, temperature=TEMPERATURE, device="cpu")
    try:
        groups = make_groups(2, 2, seed=4)
        for ref, pol in zip(be.compute_log_probs(groups, reference=True), be.compute_log_probs(groups), strict=True):
            np.testing.assert_allclose(ref, pol, atol=1e-6)
        m1 = be.update(groups)
        assert m1["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)
        m2 = be.update(groups)
        assert m2["actor/kl_loss"] > 0
        want = m2["actor/pg_loss"] - 0.01 * m2["actor/entropy_loss"] + 0.5 * m2["actor/kl_loss"]
        assert m2["actor/loss"] == pytest.approx(want, rel=1e-4, abs=1e-6)
    finally:
        be.shutdown()
    # shutdown() gives back the placement groups (one CPU per rank), not only the actors.
    deadline = time.monotonic() + 20
    while ray_local.available_resources().get("CPU", 0) < cpus_before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_local.available_resources().get("CPU", 0) >= cpus_before


def test_a_rank_that_does_not_answer_in_time_raises_instead_of_hanging(be1):
    from fully_async.training.verl_backend import TrainerTimeout

    _reset(be1)
    timeout = be1.ranks.timeout
    be1.ranks.timeout = 0.001
    try:
        with pytest.raises(TrainerTimeout, match="policy.infer_batch"):
            be1.compute_log_probs(make_groups(2, 2))
    finally:
        be1.ranks.timeout = timeout
    assert len(be1.compute_log_probs(make_groups(1, 1))) == 1  # the late answer does not wedge later calls


def test_learning_rate_warms_up_then_decays(ray_local, tiny_model):
    from fully_async.training import build_backend

    trainer = TrainerConfig(lr=1e-3, lr_warmup_steps=2, lr_schedule="cosine", total_steps=6, max_token_len_per_gpu=512)
    be = build_backend(trainer, AlgorithmConfig(), tiny_model, device="cpu")
    try:
        groups = make_groups(1, 2)
        lrs = [be.update(groups)["actor/lr"] for _ in range(6)]
    finally:
        be.shutdown()
    peak = lrs.index(max(lrs))
    assert max(lrs) == pytest.approx(1e-3, rel=1e-6)
    assert all(a < b for a, b in zip(lrs[:peak], lrs[1 : peak + 1])), lrs
    assert all(a > b for a, b in zip(lrs[peak:], lrs[peak + 1 :])), lrs


def test_cpu_set_pins_each_rank_and_sizes_its_threads(ray_local, tiny_model):
    import os

    from fully_async.training import build_backend

    core = max(os.sched_getaffinity(0))
    be = build_backend(TrainerConfig(max_token_len_per_gpu=512), AlgorithmConfig(), tiny_model, device="cpu",
                       cpu_set=[core])  # fmt: skip
    try:
        (info,) = be.ranks.call_all("policy", "rank_info")
        metrics = be.update(make_groups(1, 2))
    finally:
        be.shutdown()
    assert info["cpus"] == [core] and info["torch_threads"] == 1
    assert np.isfinite(metrics["actor/pg_loss"])


def _registry_cases():
    from fully_async.config.sections import NEEDS_CRITIC, NEEDS_UNBUILT
    from fully_async.config.verl_registry import registered_names

    estimators, losses = registered_names()
    # gae builds its own backend with a critic: tests/integration/test_verl_critic.py.
    cases = [[f"algorithm.adv_estimator={e}"] for e in estimators if e not in (*NEEDS_UNBUILT, *NEEDS_CRITIC)]
    cases += [[f"algorithm.policy_loss={name}"] for name in losses]
    extra = {
        "algorithm.adv_estimator=gdpo": ["algorithm.gdpo_reward_keys=[acc,rule]"],
        "algorithm.policy_loss=dro": ["+algorithm.policy_loss_args.dro_beta=0.1"],
        "algorithm.policy_loss=bypass_mode": ["algorithm.rollout_correction.preset=bypass_pg_is"],
    }
    return [c + extra.get(c[0], []) for c in cases]


@pytest.mark.parametrize("overrides", _registry_cases(), ids=lambda o: o[0].split(".")[1])
def test_every_registered_estimator_and_loss_runs_an_update(be1, overrides, tmp_path):
    from fully_async.config import compose

    algorithm = compose(overrides).algorithm
    be1.load_checkpoint(be1.fa_init)
    be1.set_algorithm(algorithm)
    groups = make_groups(2, 4, seed=11)
    for t in flatten(groups):  # reward components for gdpo: the function's own output and the source's score
        t.reward_info = {"acc": float(t.sample_index % 2), "sources": {"rule": {"score": t.reward}}}
    before = _weights(be1, tmp_path / "before")
    m = be1.update(groups)
    assert be1.actor_config.policy_loss.loss_mode == algorithm.policy_loss
    assert np.isfinite(m["actor/pg_loss"]), m
    after = _weights(be1, tmp_path / "after")
    assert any(not torch.equal(before[k], after[k]) for k in before), "the update changed no weight"
    be1.set_algorithm(AlgorithmConfig())


def _engine_in_a_thread(model_dir, sender, group: str):
    """The vLLM worker extension's own receiver (a stand-in model runner records what it loads), joined to a weight
    group of 2 with `sender`; returns (receiver, what it loaded, the sender's plan)."""
    import importlib.util
    from types import SimpleNamespace

    from fully_async.engines.vllm import EXTENSION_DIR

    spec = importlib.util.spec_from_file_location("fa_weight_receiver", EXTENSION_DIR / "fa_weight_receiver.py")
    rx = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rx)
    loaded = {}
    worker = rx.WeightReceiver()
    worker.model_config = SimpleNamespace(model=str(model_dir))
    worker.model_runner = SimpleNamespace(reload_weights=lambda weights_iterator: loaded.update(
        {k: v.clone() for k, v in weights_iterator}))  # fmt: skip
    plan = sender.plan()
    worker.fa_check(json.dumps({"tensors": plan}))
    host, port = sender.listen(True, 60)
    join = {"host": host, "port": port, "world": 2, "rank_offset": 1, "group": group, "backend": "gloo",
            "timeout_s": 60}  # fmt: skip
    joining = threading.Thread(target=worker.fa_join, args=(json.dumps(join),))
    joining.start()
    sender.form(group, 2, "gloo", 60)
    joining.join()
    return worker, loaded, plan


def _receive(worker, group: str, buckets) -> threading.Thread:
    receiving = threading.Thread(target=worker.fa_receive,
                                 args=(json.dumps({"group": group, "dtype": "float32", "buckets": buckets}),))  # fmt: skip
    receiving.start()
    return receiving


def test_rank_0_sends_the_full_weights_collectively_while_every_rank_gathers(be2, tmp_path):
    """The collective transport's sending side at 2 FSDP2 ranks: rank 0 broadcasts what the per-tensor iterator
    gathers (rank 1 drains it with it) into the vLLM worker extension's own methods, here in threads of this
    process with a stand-in model runner; what arrives equals the exported safetensors."""
    from fully_async.weights.collective_sender import layout_buckets

    ref = _weights(be2, tmp_path / "ref")
    sender = be2.weight_sender()
    worker, loaded, plan = _engine_in_a_thread(tmp_path / "ref", sender, "g")
    assert sorted(p[0] for p in plan) == sorted(ref)
    buckets = layout_buckets(plan, "float32", 64 << 10)
    receiving = _receive(worker, "g", buckets)
    stats = sender.send(buckets, "float32")
    receiving.join(timeout=120)
    sender.close()
    assert stats["bytes"] == sum(t.numel() * 4 for t in ref.values())
    assert sorted(loaded) == sorted(ref)
    for name, t in ref.items():
        assert torch.equal(loaded[name], t), name


@pytest.mark.parametrize("staging", ["device", "pinned"])
def test_rank_0_stages_a_copy_that_the_next_update_does_not_change_while_its_broadcast_waits(be2, tmp_path, staging):
    """async_training.sync_mode=background with the collective transport at 2 FSDP2 ranks: `stage` returns once
    rank 0 holds a copy (advanced.staging) and its broadcast has started; the next update runs on the same
    ranks while that broadcast waits for the engine, and the engine then receives the weights as they were at the
    stage. After a re-formed group (an engine server restarted), `send_staged` sends the same copy into it."""
    from fully_async.weights.collective_sender import layout_buckets

    _reset(be2)
    ref = _weights(be2, tmp_path / "ref")
    sender = be2.weight_sender()
    worker, loaded, plan = _engine_in_a_thread(tmp_path / "ref", sender, "staged")
    buckets = layout_buckets(plan, "float32", 64 << 10)
    stats = sender.stage(buckets, "float32", staging)
    assert stats["bytes"] == sum(t.numel() * 4 for t in ref.values())
    be2.update(make_groups(2, 4, seed=26))  # the next optimizer step, while rank 0's broadcast waits
    receiving = _receive(worker, "staged", buckets)
    receiving.join(timeout=120)
    restarted, loaded_again, _ = _engine_in_a_thread(tmp_path / "ref", sender, "staged-again")
    sender.send_staged()
    _receive(restarted, "staged-again", buckets).join(timeout=120)
    sender.close()
    after = _weights(be2, tmp_path / "after")
    assert any(not torch.equal(after[k], ref[k]) for k in ref), "the update changed no weight"
    for got in (loaded, loaded_again):
        assert sorted(got) == sorted(ref)
        for name, t in ref.items():
            assert torch.equal(got[name], t), name


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_staged_export_writes_the_weights_of_its_stage_while_the_next_update_runs(be1, be2, tmp_path, ranks):
    """The disk transport's background sync with the verl backend at 1 and 2 FSDP2 ranks: `stage_weights` returns
    once the copy is sent (each rank runs it before the next update's calls); the next update runs while rank 0's
    thread writes the copy, and the directory, which appears whole, holds the weights as they were at the stage,
    with the model's files, and its recorded digest."""
    from fully_async.weights.disk import files_digest

    be2 = be1 if ranks == 1 else be2
    _reset(be2)
    ref = _weights(be2, tmp_path / "ref")
    finish = be2.stage_weights(tmp_path / "v1")
    be2.update(make_groups(2, 4, seed=27))  # the next optimizer step, while rank 0 writes
    finish()
    after = _weights(be2, tmp_path / "after")
    assert any(not torch.equal(after[k], ref[k]) for k in ref), "the update changed no weight"
    staged = _weights(be2, tmp_path / "v1", export=False)
    assert sorted(staged) == sorted(ref)
    for name, t in ref.items():
        assert torch.equal(staged[name], t), name
    assert (tmp_path / "v1" / "config.json").is_file() and files_digest(tmp_path / "v1") == files_digest(
        tmp_path / "ref"
    )
    assert not list(tmp_path.glob(".v1.partial"))


def test_a_staged_export_that_cannot_be_written_fails_with_the_writers_reason(be1, tmp_path):
    (tmp_path / "v1").write_text("")  # a file where the directory should appear
    finish = be1.stage_weights(tmp_path / "v1")
    with pytest.raises(RuntimeError, match=r"writing the weights into .*v1 failed: NotADirectoryError"):
        finish()


@pytest.mark.parametrize(
    "preset",
    ["decoupled_geo_rs_token_tis", "decoupled_k3_rs", "decoupled_token_icepop", "bypass_pg_geo_rs",
     "bypass_ppo_clip_k3_rs"],
)  # fmt: skip
def test_verl_correction_presets_run_an_update_and_reject_what_is_off(be1, preset, tmp_path):
    """One real update per mode family (decoupled / bypass, IS / IcePop / geometric and k3 rejection): half the
    sequences' behaviour log-probs are moved off the trainer's, the rest match; the rejecting presets reject some
    tokens, never all, and the policy moves. (That the rejection reaches the gradient:
    test_a_rejecting_correction_updates_as_the_kept_tokens_alone_would.)"""
    from fully_async.config import compose

    algorithm = compose([f"algorithm.rollout_correction.preset={preset}"]).algorithm
    icepop = algorithm.rollout_correction.rollout_rs is None and algorithm.rollout_correction.rejects()
    _reset(be1)
    groups = _on_policy(be1, make_groups(3, 4, seed=13, response_len=(3, 6), version=2))
    for t in flatten(groups)[::2]:  # pi_prox / pi_behave = e per token; e^2 for IcePop, outside its [0.5, 5]
        t.behaviour_logprobs = t.behaviour_logprobs - (2.0 if icepop else 1.0)
    be1.set_algorithm(algorithm)
    before = _weights(be1, tmp_path / "before")
    m = be1.update(groups, version=3)
    assert np.isfinite(m["actor/pg_loss"])
    after = _weights(be1, tmp_path / "after")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    rejected = m.get("offpolicy/rejected_token_frac", m.get("rollout_corr/rollout_rs_masked_fraction"))
    if algorithm.rollout_correction.rollout_rs is not None:
        assert 0 < rejected < 1, m
    if icepop:  # an IS weight outside the bounds is zeroed (verl counts it out of bounds, not as rejected)
        assert 0 < m["rollout_corr/rollout_is_oob_ratio"] < 1, m
    if not algorithm.bypass:  # the trainer's own pass: the mismatch, all of it one version old
        assert m["offpolicy/staleness_1/k3"] == pytest.approx(m["offpolicy/k3"]) and m["offpolicy/k3"] > 0.1


def test_mismatch_reads_zero_at_staleness_0_when_the_behaviour_is_the_trainers(be1):
    _reset(be1)
    groups = _on_policy(be1, make_groups(3, 2, seed=5, version=4))
    m = be1.update(groups, version=4)
    for key in ("k1", "k3", "abs_diff", "ratio_above_tail", "ratio_below_tail"):
        assert abs(m[f"offpolicy/staleness_0/{key}"]) < 1e-6, key
    assert m["offpolicy/staleness_0/tokens"] == m["batch/loss_tokens"]


# ----------------------------------------------------------------- the correction reaches the gradient
def _off_by(be, shift: float, seed: int = 13):
    """Groups whose behaviour log-probs are the trainer's own, those of every other trajectory lowered by `shift`
    (pi_prox / pi_behave = e^shift on each of their tokens); returns (groups, the shifted trajectories' indices in
    `flatten` order, their loss tokens, all loss tokens)."""
    _reset(be)
    groups = _on_policy(be, make_groups(3, 4, seed=seed, response_len=(3, 6), version=2))
    trajs = flatten(groups)
    shifted = list(range(0, len(trajs), 2))
    for i in shifted:
        trajs[i].behaviour_logprobs = trajs[i].behaviour_logprobs - shift
    return groups, shifted, sum(len(trajs[i].response_ids) for i in shifted), sum(len(t.response_ids) for t in trajs)


def _update(be, algorithm, groups, out):
    """One update from the initial weights with `algorithm`: (its metrics, the weights after it)."""
    be.load_checkpoint(be.fa_init)
    be.set_algorithm(algorithm)
    m = be.update(groups, version=3)
    return m, _weights(be, out)


def _uncorrected():
    from fully_async.config.sections.rollout_correction import RolloutCorrectionConfig

    return AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(rollout_is=None, allow_uncorrected=True))


def _tis(cap: float):
    from fully_async.config.sections.rollout_correction import RolloutCorrectionConfig

    return AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=cap))


def _max_abs_diff(a, b) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize(("preset", "shift"), [("decoupled_k3_rs", 1.0), ("decoupled_token_icepop", 2.0)])
def test_a_rejecting_correction_updates_as_the_kept_tokens_alone_would(be1, preset, shift, tmp_path):
    """Decoupled mode, the same initial weights and groups, the job's algorithm (its entropy bonus included): an
    update whose correction rejects the shifted trajectories (k3 rejection: their seq-mean k3 is e^-1 > 0.01; IcePop:
    their ratio e^2 is outside [0.5, 5], so their IS weight is 0) equals an uncorrected update in which those tokens
    are out of the loss mask, with the denominator kept (training/correction.py; patch 0008 for the entropy): its
    policy loss, entropy and (pre-clip) gradient norm are the masked update's times kept / all loss tokens, and the
    weights Adam's first step leaves (about lr x the gradient's sign: the same for a gradient scaled by a constant)
    are the same, within lr / 10: Adam's eps (1e-8) lets an entry whose gradient is that small move differently
    (1.5e-5 measured), where a different update moves entries by about lr."""
    import copy

    from fully_async.config import compose
    from fully_async.config.sections.rollout_correction import RolloutCorrectionConfig

    groups, shifted, n_shifted, n_all = _off_by(be1, shift)
    algorithm = compose([f"algorithm.rollout_correction.preset={preset}"]).algorithm
    assert algorithm.entropy_coeff > 0
    uncorrected = dataclasses.replace(
        algorithm, rollout_correction=RolloutCorrectionConfig(rollout_is=None, allow_uncorrected=True)
    )
    m, rejecting = _update(be1, algorithm, groups, tmp_path / "rejecting")
    if algorithm.rollout_correction.rollout_rs is not None:
        assert m["offpolicy/rejected_token_frac"] == pytest.approx(n_shifted / n_all), m
    else:  # IcePop zeroes the IS weight of a token outside its bounds
        assert m["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(n_shifted / n_all), m
    kept = copy.deepcopy(groups)
    for i in shifted:
        flatten(kept)[i].loss_mask[:] = 0
    m_kept, masked = _update(be1, uncorrected, kept, tmp_path / "masked")
    _, everything = _update(be1, uncorrected, groups, tmp_path / "uncorrected")
    assert m_kept["batch/loss_tokens"] == n_all - n_shifted
    scale = (n_all - n_shifted) / n_all
    for key in ("actor/pg_loss", "actor/entropy_loss", "actor/loss", "actor/grad_norm"):
        assert m[key] == pytest.approx(m_kept[key] * scale, rel=1e-4, abs=1e-7), key
    same, moved = _max_abs_diff(rejecting, masked), _max_abs_diff(rejecting, everything)
    print(f"\n{preset}: max |w_rejecting - w_kept_alone| = {same:.2e}, vs uncorrected {moved:.2e}")
    assert same < 1e-4 and moved > 1e-3, (same, moved)


def test_token_tis_weighs_the_update_by_the_ratio_up_to_a_cap_that_binds(be1, tmp_path):
    """Token TIS in decoupled mode on the same initial weights and groups, the shifted trajectories' tokens at ratio
    e: a cap of 2 binds (their weight is 2, not e) and gives another update than no correction and than a cap of 100,
    which does not bind (weight e); on the trainer's own behaviour (every ratio 1) a cap of 100 gives the uncorrected
    update. Updates compared by the parameters after one step, and by the policy loss, linear in the weights at
    pi_theta = pi_prox: (loss(cap 2) - loss(none)) / (loss(cap 100) - loss(none)) = (2 - 1) / (e - 1)."""
    import copy

    groups, _, _, _ = _off_by(be1, 1.0)
    none, w_none = _update(be1, _uncorrected(), groups, tmp_path / "none")
    binds, w_binds = _update(be1, _tis(2.0), groups, tmp_path / "binds")
    loose, w_loose = _update(be1, _tis(100.0), groups, tmp_path / "loose")
    be1.load_checkpoint(be1.fa_init)
    on_policy = _on_policy(be1, copy.deepcopy(groups))
    _, w_on_none = _update(be1, _uncorrected(), on_policy, tmp_path / "on_none")
    _, w_on_loose = _update(be1, _tis(100.0), on_policy, tmp_path / "on_loose")
    diffs = {"cap 2 vs none": _max_abs_diff(w_binds, w_none), "cap 2 vs cap 100": _max_abs_diff(w_binds, w_loose),
             "cap 100 vs none": _max_abs_diff(w_loose, w_none),
             "ratios 1: cap 100 vs none": _max_abs_diff(w_on_loose, w_on_none)}  # fmt: skip
    print("\nTIS, max abs weight difference after one update:", {k: f"{v:.2e}" for k, v in diffs.items()})
    assert min(diffs["cap 2 vs none"], diffs["cap 2 vs cap 100"], diffs["cap 100 vs none"]) > 1e-3, diffs
    assert diffs["ratios 1: cap 100 vs none"] < 1e-4, diffs
    assert binds["rollout_corr/rollout_is_max"] == pytest.approx(2.0)
    assert loose["rollout_corr/rollout_is_max"] == pytest.approx(np.e, rel=1e-4)
    gain = (binds["actor/pg_loss"] - none["actor/pg_loss"]) / (loose["actor/pg_loss"] - none["actor/pg_loss"])
    assert gain == pytest.approx(1 / (np.e - 1), rel=1e-3)
