"""algorithm.rollout_correction: verl's keys and presets, the fail-closed rule, rejection that keeps the loss
denominator, and the mismatch diagnostics split by staleness (fully_async/training/correction.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fully_async.config import ConfigError, RolloutCorrectionConfig, compose
from fully_async.config.sections.rollout_correction import PRESETS
from fully_async.protocol import NO_VERSION
from fully_async.training.correction import correct, diagnostics

VERL_KEYS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold",
             "bypass_mode", "loss_type")  # fmt: skip


def test_presets_are_verls_own():
    import inspect

    from verl.trainer.config import RolloutCorrectionConfig as Verl

    theirs = {
        n for n, m in inspect.getmembers(Verl, inspect.ismethod) if m.__self__ is Verl and not n.startswith("_")
    } - {"from_dict"}
    assert set(PRESETS) == theirs
    for name in PRESETS:
        want = getattr(Verl, name)()
        got = RolloutCorrectionConfig(preset=name)
        assert {k: getattr(got, k) for k in VERL_KEYS} == {k: getattr(want, k) for k in VERL_KEYS}, name


def test_preset_by_name_and_keys_that_override_it():
    rc = compose(["algorithm.rollout_correction.preset=decoupled_geo_rs_token_tis",
                  "algorithm.rollout_correction.rollout_rs_threshold=0.99_1.01"]).algorithm.rollout_correction  # fmt: skip
    assert (rc.rollout_is, rc.rollout_rs, rc.rollout_rs_threshold, rc.bypass_mode) == (
        "token", "seq_mean_k1", "0.99_1.01", False)  # fmt: skip
    with pytest.raises(ConfigError, match="did you mean 'decoupled_k3_rs'"):
        compose(["algorithm.rollout_correction.preset=decoupled_k3_r"])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["algorithm.rollout_correction.rollout_rs=seq_mean_k4"], "did you mean 'seq_mean_k3'"),
        (["algorithm.rollout_correction.rollout_rs=seq_mean_k3"], "rollout_rs_threshold must be set"),
        (["algorithm.rollout_correction.rollout_rs=token_k2",
          "algorithm.rollout_correction.rollout_rs_threshold='0.5_2'"], "rollout_rs_threshold \\(token_k2\\) must be"),
        (["algorithm.rollout_correction.rollout_is_threshold='5_0.5'"], "lower <= upper"),
        (["algorithm.rollout_correction.rollout_is_threshold=0.5_5"], "unquoted 0.5_5 reads as 0.55"),
        (["algorithm.rollout_correction.loss_type=ppo"], "'ppo_clip' or 'reinforce'"),
        (["algorithm.rollout_correction.bypass_mode=true", "algorithm.policy_loss=gspo",
          "algorithm.rollout_correction.loss_type=reinforce"], "without verl's bypass correction"),
    ],
)  # fmt: skip
def test_bad_correction_settings_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        compose(overrides)


def test_older_keys_are_aliases():
    algo = compose(["algorithm.rollout_is=sequence", "algorithm.rollout_is_threshold=3.0",
                    "algorithm.rollout_correction.allow_uncorrected=true", "algorithm.recompute_prox=false"]).algorithm  # fmt: skip
    rc = algo.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.bypass_mode, algo.bypass) == ("sequence", 3.0, True, True)


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.rollout_correction.preset=bypass_ppo_clip"],
        ["algorithm.rollout_correction.preset=disabled"],
        ["algorithm.rollout_correction.bypass_mode=true"],  # ppo_clip ignores the IS weights it would compute
    ],
)
def test_an_async_run_that_corrects_nothing_is_refused(overrides):
    with pytest.raises(ConfigError, match="corrects nothing.*decoupled_geo_rs_token_tis.*allow_uncorrected=true"):
        compose(overrides)
    compose([*overrides, "algorithm.rollout_correction.allow_uncorrected=true"])
    compose([*overrides, "async_training.max_staleness=0"])


@pytest.mark.parametrize(
    "preset", ["decoupled_token_is", "decoupled_k3_rs", "bypass_pg_geo_rs", "bypass_ppo_clip_geo_rs"]
)
def test_a_correcting_preset_is_accepted_at_any_staleness(preset):
    compose([f"algorithm.rollout_correction.preset={preset}", "async_training.max_staleness=8"])


HEAVY = ("ray", "torch", "transformers", "vllm", "verl")
"""What the runner imports only once the command line is known to be good (its start-up's seconds are theirs)."""


def test_the_runner_refuses_an_uncorrected_async_run_before_ray_and_any_heavy_import(tmp_path):
    """The refusal is the command line's check (runner.cli), reached with none of HEAVY imported: what keeps it
    within seconds on any machine. Its time is measured, not asserted: docs/benchmarks.md, off-policy."""
    probe = (
        "import sys\n"
        "from fully_async import runner\n"
        "sys.argv[1:] = ['algorithm.rollout_correction.preset=bypass_ppo_clip']\n"
        "code = runner.cli()\n"
        f"print('imported:', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
        "sys.exit(code)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "corrects nothing" in proc.stderr
    assert "imported: []" in proc.stdout.splitlines()


def _logps(seed=0, b=4, r=5):
    g = torch.Generator().manual_seed(seed)
    behave = -torch.rand(b, r, generator=g) * 3
    prox = behave + 0.3 * torch.randn(b, r, generator=g)
    mask = torch.ones(b, r, dtype=torch.bool)
    mask[1, 3:] = False
    return prox, behave, mask


def test_rejected_tokens_weigh_zero_and_keep_their_place_in_the_mask():
    prox, behave, mask = _logps()
    behave[0] = prox[0] - 3.0  # row 0: geometric-mean ratio e^3, far outside the bounds
    rc = RolloutCorrectionConfig(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.5_2.0")
    w, m = correct(prox, behave, mask, rc, group_index=["a", "a", "b", "b"])
    assert w is not None and torch.all(w[0] == 0)
    assert torch.all(w[2:][mask[2:]] == 1)
    assert m["offpolicy/rejected_seqs"] == 1 and m["offpolicy/rejected_tokens"] == 5
    assert m["offpolicy/rejected_token_frac"] == pytest.approx(5 / int(mask.sum()))
    assert m["offpolicy/groups_all_rejected"] == 0  # group a still has row 1


def test_icepops_zeroed_tokens_count_as_rejected():
    """IcePop (rollout_is_threshold 'lower_upper') zeroes the weight of a token whose ratio leaves the bound: that is
    a rejection (RolloutCorrectionConfig.rejects()), counted as one; the weights themselves are verl's."""
    prox, behave, mask = _logps(4)
    behave[:] = prox
    behave[0, :2] = prox[0, :2] - 2.0  # two tokens with ratio e^2, outside [0.5, 2]
    rc = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold="0.5_2.0")
    assert rc.rejects()
    w, m = correct(prox, behave, mask, rc, group_index=["a", "a", "b", "b"])
    assert w is not None and torch.all(w[0, :2] == 0) and torch.all(w[mask & (w != 0)] > 0)
    assert m["offpolicy/rejected_tokens"] == 2
    assert m["offpolicy/rejected_token_frac"] == pytest.approx(2 / int(mask.sum()))
    assert m["offpolicy/rejected_seqs"] == 0


def test_rejection_keeps_the_loss_denominator():
    """verl's vanilla loss with the weights `correct` gives: the rejected row adds 0, the mean is over all tokens."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import FSDPActorConfig

    prox, behave, mask = _logps(1)
    behave[0] = prox[0] - 3.0
    rc = RolloutCorrectionConfig(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.5_2.0")
    w, _ = correct(prox, behave, mask, rc)
    config = FSDPActorConfig(strategy="fsdp2", rollout_n=1, use_dynamic_bsz=True)
    adv = torch.ones_like(prox)
    loss, _ = get_policy_loss_fn("vanilla")(old_log_prob=prox, log_prob=prox, advantages=adv, response_mask=mask,
                                            loss_agg_mode="token-mean", config=config, rollout_is_weights=w)  # fmt: skip
    kept = mask.clone()
    kept[0] = False
    assert float(loss) == pytest.approx(-float(kept.sum()) / float(mask.sum()))


def test_a_group_whose_samples_are_all_rejected_is_counted():
    prox, behave, mask = _logps(2)
    behave[2:] = prox[2:] - 3.0
    rc = RolloutCorrectionConfig(rollout_is="token", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.5_2.0")
    w, m = correct(prox, behave, mask, rc, group_index=["a", "a", "b", "b"])
    assert m["offpolicy/groups_all_rejected"] == 1 and torch.all(w[2:] == 0)


def test_no_is_and_no_rejection_gives_no_weights():
    prox, behave, mask = _logps(3)
    w, m = correct(prox, behave, mask, RolloutCorrectionConfig(rollout_is=None))
    assert w is None and "rollout_corr/k3_kl" in m


def test_diagnostics_read_zero_when_trainer_and_engine_agree():
    prox, _, mask = _logps(4)
    versions = torch.full(prox.shape, 7)
    d = diagnostics(prox, prox.clone(), mask, versions, 7)
    for key in ("abs_diff", "k1", "k2", "k3", "ratio_above_tail", "ratio_below_tail"):
        assert d[f"offpolicy/{key}"] == 0 and d[f"offpolicy/staleness_0/{key}"] == 0
    assert d["offpolicy/ess"] == pytest.approx(1.0) and d["offpolicy/nonfinite_frac"] == 0


def test_diagnostics_split_the_mismatch_by_staleness():
    prox, behave, mask = _logps(5)
    versions = torch.tensor([[9], [9], [6], [1]]).expand_as(prox).clone()
    behave[:2] = prox[:2]  # the current version's rows: numerics agree exactly
    versions[3, 0] = NO_VERSION  # a token of unknown version (a tool's) enters only the overall numbers
    prox[2, 1] = float("nan")
    d = diagnostics(prox, behave, mask, versions, 9)
    assert d["offpolicy/staleness_0/k3"] == 0 and d["offpolicy/staleness_0/tokens"] == int(mask[:2].sum())
    assert d["offpolicy/staleness_3_4/k3"] > 0 and d["offpolicy/staleness_3_4/tokens"] == 4  # the NaN left out
    assert d["offpolicy/staleness_5_8/tokens"] == 4
    assert d["offpolicy/nonfinite_frac"] == pytest.approx(1 / int(mask.sum()))
    assert d["offpolicy/k3"] > 0 and "offpolicy/staleness_1/k3" not in d


def test_diagnostics_split_the_mismatch_by_the_kv_caches_staleness_too():
    """on_sync=keep: a token made at the trainer's version over a cache written 2 versions earlier is at staleness 0
    by its own version and 2 by its cache's; both splits are reported, and how many tokens' caches are older."""
    prox, behave, mask = _logps(6)
    versions = torch.full(prox.shape, 9)
    cache = versions.clone()
    cache[1:] = 7
    d = diagnostics(prox, behave, mask, versions, 9, cache)
    assert d["offpolicy/staleness_0/tokens"] == int(mask.sum())
    assert d["offpolicy/cache_staleness_0/tokens"] == int(mask[0].sum())
    assert d["offpolicy/cache_staleness_2/tokens"] == int(mask[1:].sum())
    assert d["offpolicy/cache_older_tokens"] == int(mask[1:].sum())
    assert "offpolicy/cache_older_tokens" not in diagnostics(prox, behave, mask, versions, 9)


def test_verls_rollout_correction_keys_pass_straight_through():
    from fully_async.config.verl_keys import translate

    line = ["algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_rs=seq_mean_k3",
            "algorithm.rollout_correction.rollout_rs_threshold=0.02",
            "algorithm.rollout_correction.rollout_is_batch_normalize=true"]  # fmt: skip
    t = translate(line)
    assert t.overrides == line and not t.notes and not t.problems
    rc = compose(line).algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_rs, rc.rollout_rs_threshold, rc.rollout_is_batch_normalize) == (
        "sequence", "seq_mean_k3", 0.02, True)  # fmt: skip
