"""The verl patches in patches/: each test exercises the verl code a patch fixes and fails on unpatched verl
(verified with `scripts/apply_verl_patches.sh --revert`), and the apply script's check / idempotence / version guard."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "apply_verl_patches.sh"


def _verl_files() -> dict[str, str]:
    import verl

    base = Path(verl.__file__).parent
    names = [
        "utils/distributed.py",
        "workers/engine/fsdp/transformer_impl.py",
        "trainer/ppo/core_algos.py",
        "utils/torch_functional.py",
        "workers/utils/losses.py",
    ]
    return {n: hashlib.sha256((base / n).read_bytes()).hexdigest() for n in names}


def test_check_passes_after_setup_and_a_second_apply_is_a_no_op():
    check = subprocess.run([str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    before = _verl_files()
    again = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stderr
    assert all(line.startswith("present") for line in again.stdout.splitlines()), again.stdout
    assert _verl_files() == before


def test_script_refuses_another_verl_version(tmp_path):
    fake = tmp_path / "site" / "verl"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '0.9.0'\n")
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "site"} exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    r = subprocess.run(
        [str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHON": str(wrapper)}
    )
    assert r.returncode == 1
    assert "verl 0.9.0" in r.stderr and "0.9.1 only" in r.stderr


def test_0001_cpu_process_group_backend():
    # A fresh process: the platform choice and the default process group are process-wide.
    code = textwrap.dedent(
        """
        import os
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
        from fully_async.training import cpu_platform
        cpu_platform.use_in_this_process()
        import torch.distributed as dist
        from verl.utils.distributed import initialize_global_process_group_ray
        initialize_global_process_group_ray(timeout_second=30)
        print("BACKEND", dist.get_backend())
        """
    )
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, "PORT": str(port)}
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "BACKEND gloo" in r.stdout


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_0003_agg_loss_of_an_all_masked_batch_is_zero(mode):
    from verl.trainer.ppo.core_algos import agg_loss

    loss_mat = torch.randn(3, 4, requires_grad=True)
    loss = agg_loss(loss_mat, torch.zeros(3, 4), mode)
    assert torch.isfinite(loss) and loss.item() == 0.0
    loss.backward()
    assert torch.isfinite(loss_mat.grad).all()
    # The global-count path (what the engine passes) too.
    assert agg_loss(loss_mat, torch.zeros(3, 4), "token-mean", dp_size=2, batch_num_tokens=0).item() == 0.0


def test_0003_does_not_change_a_normal_loss():
    from verl.trainer.ppo.core_algos import agg_loss

    loss_mat, mask = torch.arange(6.0).reshape(2, 3), torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert agg_loss(loss_mat, mask, "token-mean").item() == pytest.approx((0 + 1 + 3) / 3)
    assert agg_loss(loss_mat, mask, "token-mean", dp_size=2, batch_num_tokens=8).item() == pytest.approx(4 / 8 * 2)


def test_0004_bypass_mode_accepts_an_all_masked_micro_batch():
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import FSDPActorConfig

    config = FSDPActorConfig(strategy="fsdp2", rollout_n=1, use_dynamic_bsz=True)
    lp = -torch.rand(2, 3)
    loss, _ = get_policy_loss_fn("bypass_mode")(
        old_log_prob=lp - 0.1, log_prob=lp, advantages=torch.ones(2, 3), response_mask=torch.zeros(2, 3).bool(),
        loss_agg_mode="token-mean", config=config,
    )  # fmt: skip
    assert torch.isfinite(loss) and loss.item() == 0.0


def _graph_nodes(tensor: torch.Tensor, name: str) -> int:
    """Autograd nodes called `name` behind `tensor`."""
    seen, stack, count = set(), [tensor.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__ == name
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return count


def test_0005_logprobs_are_computed_in_chunks_not_per_token():
    from verl.utils.torch_functional import logprobs_from_logits_v2

    torch.manual_seed(0)
    packed = torch.randn(3000, 259, requires_grad=True)  # (tokens, vocab), as the engines hand it over
    labels = torch.randint(0, 259, (3000,))
    out = logprobs_from_logits_v2(packed, labels)
    # Unpatched: one logsumexp (and one autograd node) per token.
    assert _graph_nodes(out, "LogsumexpBackward0") == 1
    want = torch.log_softmax(packed, -1).gather(-1, labels[:, None])[:, 0]
    torch.testing.assert_close(out, want)
    out.sum().backward()
    assert torch.isfinite(packed.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_0005_logprobs_keep_values_and_shapes(dtype, monkeypatch):
    import verl.utils.torch_functional as vf

    monkeypatch.setattr(vf, "_LOGPROBS_CHUNK_ELEMENTS", 7 * 50)  # several chunks, the last one short
    torch.manual_seed(1)
    logits = (torch.randn(4, 9, 50) * 3).to(dtype)
    labels = torch.randint(0, 50, (4, 9))
    want = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None])[..., 0]
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.05}
    for x, y, ref in [
        (logits, labels, want),
        (logits.transpose(0, 1), labels.T, want.T),  # not viewable as rows: one leading row at a time
        (logits[0], labels[0], want[0]),
    ]:
        got = vf.logprobs_from_logits_v2(x, y)
        assert got.shape == y.shape
        torch.testing.assert_close(got.float(), ref, **tol)


def test_0006_selected_rows_of_3d_position_ids_keep_their_shape():
    """A vision-language model's (4, seq) position ids per row, selected as verl's dynamic batching does."""
    from tensordict import TensorDict
    from verl.utils.tensordict_utils import index_select_tensor_dict, nested_tensor_from_tensor_list

    rows = [torch.arange(4 * n).reshape(4, n) for n in (5, 7, 6)]
    td = TensorDict({"position_ids": nested_tensor_from_tensor_list(rows, ragged_idx=2)}, batch_size=[3])
    picked = index_select_tensor_dict(index_select_tensor_dict(td, [2, 0]), [1, 0])["position_ids"]
    # Unpatched: ragged at dim 1, (2, j, seq): what verl's engine later splits along the wrong dimension.
    assert tuple(picked.shape[:2]) == (2, 4) and picked._ragged_idx == 2
    assert [tuple(x.shape) for x in picked.unbind()] == [(4, 5), (4, 6)]
    assert torch.equal(picked.unbind()[0], rows[0]) and torch.equal(picked.unbind()[1], rows[2])


def test_0006_equal_length_rows_of_3d_position_ids_stay_ragged_in_the_sequence():
    """left_right_2_no_padding on a batch whose rows all have the same length, then a selection of rows."""
    from tensordict import TensorDict
    from verl.utils.seqlen_balancing import rearrange_micro_batches
    from verl.utils.tensordict_utils import index_select_tensor_dict
    from verl.workers.utils.padding import left_right_2_no_padding

    b, length = 3, 6
    td = TensorDict(
        {
            "input_ids": torch.arange(b * length).reshape(b, length),
            "attention_mask": torch.ones(b, length, dtype=torch.long),
            "response_mask": torch.ones(b, 2, dtype=torch.long),
            "position_ids": torch.arange(length).repeat(b, 4, 1),
        },
        batch_size=[b],
    )
    packed = left_right_2_no_padding(td)
    # Unpatched: ragged in the 4, (b, j, length), and so is every micro-batch verl's dynamic batching makes of it.
    assert tuple(packed["position_ids"].shape[:2]) == (b, 4) and packed["position_ids"]._ragged_idx == 2
    micro, _ = rearrange_micro_batches(packed, max_token_len=2 * length)
    assert [tuple(m["position_ids"].shape[:2]) for m in micro] == [(2, 4), (1, 4)]
    picked = index_select_tensor_dict(packed, [2, 0])["position_ids"]
    assert [tuple(x.shape) for x in picked.unbind()] == [(4, length), (4, length)]


def _support_by_hand(row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The tokens a top-k / nucleus sampler may draw from `row` (logits at the temperature), by the definition: the k
    largest (ties kept), then in descending order every token whose more likely tokens hold < top_p of the mass."""
    order = sorted(range(len(row)), key=lambda i: -float(row[i]))
    if top_k > 0:
        kth = float(row[order[top_k - 1]])
        order = [i for i in order if float(row[i]) >= kth]
    probs = torch.softmax(row[order].double(), -1).tolist()
    kept, mass = set(), 0.0
    for i, q in zip(order, probs, strict=True):
        if mass < top_p or not kept:
            kept.add(i)
        mass += q
    return kept


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (-1, 0.8), (20, 0.9), (1, 1.0), (-1, 0.3), (40, 0.5)])
def test_0007_truncation_keeps_the_samplers_support_and_renormalises(top_k, top_p, monkeypatch):
    import verl.utils.torch_functional as vf

    monkeypatch.setattr(vf, "_LOGPROBS_CHUNK_ELEMENTS", 7 * 64)  # several chunks, the last one short
    torch.manual_seed(2)
    logits = torch.randn(3, 10, 64) * 2
    out = vf.truncate_to_sampling_support(logits, top_k, top_p)
    lowest = torch.finfo(logits.dtype).min
    for row, got in zip(logits.reshape(-1, 64), out.reshape(-1, 64), strict=True):
        assert {i for i in range(64) if got[i] > lowest} == _support_by_hand(row, top_k, top_p)
    kept = out > lowest
    assert torch.equal(out[kept], logits[kept])
    logp = torch.log_softmax(out, -1)
    # The log-probs of the kept tokens are those of the renormalised distribution over them.
    want = logits - torch.logsumexp(logits.masked_fill(~kept, float("-inf")), -1, keepdim=True)
    torch.testing.assert_close(logp[kept], want[kept])
    assert torch.isfinite(vf.entropy_from_logits(out)).all()  # the lowest finite value, not -inf (0 * -inf = NaN)


def test_0007_off_is_the_same_tensor_and_sampled_tokens_always_stay():
    import verl.utils.torch_functional as vf

    torch.manual_seed(3)
    logits = torch.randn(6, 32, requires_grad=True)
    assert vf.truncate_to_sampling_support(logits) is logits  # top_p=1 / top_k off: bit for bit as before
    assert vf.truncate_to_sampling_support(logits, top_k=32, top_p=1.0) is logits
    sampled = logits.argmin(-1)  # outside any top-2
    out = vf.truncate_to_sampling_support(logits, top_k=2, keep=sampled)
    assert torch.isfinite(torch.log_softmax(out, -1).gather(-1, sampled[:, None])).all()
    assert ((out > torch.finfo(out.dtype).min).sum(-1) == 3).all()
    torch.log_softmax(out, -1).gather(-1, sampled[:, None]).sum().backward()
    assert (logits.grad != 0).sum() == 6 * 3  # no gradient through the dropped logits


@pytest.mark.parametrize("packed", [True, False], ids=["packed (GPU: remove-padding)", "padded (CPU)"])
def test_0007_verls_forward_gives_log_probs_and_entropy_of_the_truncated_distribution(packed):
    """verl's own FSDPEngineWithLMHead.prepare_model_outputs on given logits, both branches patch 0007 changes (the
    packed one is what GPU runs take; this project's CPU runs take the padded one), without a model or Ray."""
    from types import SimpleNamespace

    import verl.utils.torch_functional as vf
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    torch.manual_seed(4)
    vocab, temperature, top_k, top_p = 40, 0.7, 8, 0.8
    seqs = [torch.randint(0, vocab, (n,)) for n in (5, 7)]
    flat = torch.cat(seqs)
    rolled = torch.roll(flat, -1)
    logits = [torch.randn(len(s), vocab) * 3 for s in seqs]
    td = TensorDict({"input_ids": torch.nested.nested_tensor(seqs, layout=torch.jagged)}, batch_size=[2])
    tu.assign_non_tensor(td, use_remove_padding=packed, calculate_entropy=True, top_k=top_k, top_p=top_p)
    engine = object.__new__(FSDPEngineWithLMHead)  # the forward's outputs only: no model, no process group
    engine.engine_config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False)
    engine.compute_entropy_from_logits, engine.use_ulysses_sp = vf.entropy_from_logits, False
    if packed:
        output = SimpleNamespace(logits=torch.cat(logits)[None])
        args = {"input_ids_rmpad_rolled": rolled, "temperature_rmpad": torch.full((len(flat),), temperature),
                "pad_size": 0, "temperature_is_one": False}  # fmt: skip
    else:
        padded = torch.zeros(2, 7, vocab)
        for i, x in enumerate(logits):
            padded[i, : len(x)] = x
        output = SimpleNamespace(logits=padded)
        args = {
            "input_ids_rmpad_rolled": rolled,
            "temperature": torch.full((2,), temperature),
            "temperature_is_one": False,
        }
    out = engine.prepare_model_outputs(output, args, td, None)
    got_lp, got_ent = out["log_probs"].values(), out["entropy"].values()
    k, checked = 0, 0
    for s, x in zip(seqs, logits, strict=True):
        for t in range(len(s)):
            # A row's last position predicts no token of it (its label is the next row's first token in verl's packed
            # roll; the padded branch keeps another one there): no log-prob of it is ever read.
            if t < len(s) - 1:
                row, label = x[t] / temperature, int(rolled[k])
                support = sorted(_support_by_hand(row, top_k, top_p) | {label})
                want = torch.log_softmax(row[support], -1)
                assert len(support) < vocab
                torch.testing.assert_close(got_lp[k], want[support.index(label)])
                torch.testing.assert_close(got_ent[k], -(want.exp() * want).sum())
                checked += 1
            k += 1
    assert k == len(flat) and checked == len(flat) - len(seqs)


def _ppo_loss_metrics(config, weights=None, behave_shift=(0.0, 0.0)) -> dict[str, float]:
    """verl's own ppo_loss on two 3-token responses whose entropies are 1 (row 0) and 5 (row 1), all loss tokens,
    the global count of 6 loss tokens passed as the engine passes it; `weights`: the rollout-correction weights per
    row, `behave_shift`: how far below pi_theta each row's behaviour (old) log-probs sit."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    rows, prompt, resp = 2, 2, 3
    torch.manual_seed(8)
    lp = -torch.rand(rows, prompt + resp)
    entropy = torch.tensor([[0.0, 1, 1, 1, 9], [0.0, 5, 5, 5, 9]])  # the model's outputs, shifted by one in the loss
    own = lp[:, prompt - 1 : -1]
    data = {
        "prompts": torch.ones(rows, prompt, dtype=torch.long),
        "responses": torch.ones(rows, resp, dtype=torch.long),
        "attention_mask": torch.ones(rows, prompt + resp, dtype=torch.long),
        "response_mask": torch.ones(rows, resp),
        "old_log_probs": own - torch.tensor(behave_shift)[:, None],
        "advantages": torch.ones(rows, resp),
        "ref_log_prob": own - 1.0,
    }
    if weights is not None:
        data["rollout_is_weights"] = torch.tensor(weights)[:, None].expand(rows, resp).clone()
    td = TensorDict(data, batch_size=[rows])
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=rows * resp, global_batch_size=None)
    _, metrics = ppo_loss(config, {"log_probs": lp.reshape(-1), "entropy": entropy.reshape(-1)}, td)
    return {k: float(v.values[0]) for k, v in metrics.items() if k in ("actor/entropy_loss", "kl_loss")}


def test_0008_rejected_tokens_add_no_entropy_or_kl():
    """A rejected token (weight 0 in decoupled mode; outside the bypass_mode loss's geometric-mean bound) adds
    neither to the entropy bonus nor to the KL loss, and stays in their denominator (6 tokens)."""
    from verl.trainer.config import RolloutCorrectionConfig
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    common = dict(strategy="fsdp2", rollout_n=1, use_dynamic_bsz=True, entropy_coeff=0.1, use_kl_loss=True)
    decoupled = FSDPActorConfig(**common)
    kept = _ppo_loss_metrics(decoupled, weights=[1.0, 1.5])
    assert kept["actor/entropy_loss"] == pytest.approx((3 * 1 + 3 * 5) / 6)
    row1_rejected = _ppo_loss_metrics(decoupled, weights=[1.0, 0.0])
    assert row1_rejected["actor/entropy_loss"] == pytest.approx(3 * 1 / 6)
    assert row1_rejected["kl_loss"] == pytest.approx(kept["kl_loss"] / 2)  # each token's KL is the same here
    rs = RolloutCorrectionConfig(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001")
    bypass = FSDPActorConfig(**common, policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=rs))
    assert _ppo_loss_metrics(bypass, behave_shift=(0.0, 0.0))["actor/entropy_loss"] == pytest.approx(18 / 6)
    by_rs = _ppo_loss_metrics(bypass, behave_shift=(0.0, 0.5))  # row 1's geometric-mean ratio e^0.5: rejected
    assert by_rs["actor/entropy_loss"] == pytest.approx(3 / 6)
    assert by_rs["kl_loss"] == pytest.approx(kept["kl_loss"] / 2)
    # IcePop in bypass mode with REINFORCE: the loss weighs row 1 (ratio e^-2, under its 0.5 bound) by 0.
    icepop = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold="0.5_5.0", loss_type="reinforce",
                                     bypass_mode=True)  # fmt: skip
    by_is = FSDPActorConfig(**common, policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=icepop))
    assert _ppo_loss_metrics(by_is, behave_shift=(0.0, -2.0))["actor/entropy_loss"] == pytest.approx(3 / 6)
    # Per-sequence means: the rejected row still counts as a sequence (mean 0), not left out ((1 + 0) / 2, not 1).
    seq_mean = FSDPActorConfig(**common, loss_agg_mode="seq-mean-token-mean")
    assert _ppo_loss_metrics(seq_mean, weights=[1.0, 0.0])["actor/entropy_loss"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("overrides", "needs_0008"),
    [
        (["algorithm.rollout_correction.preset=decoupled_geo_rs_token_tis"], True),
        (["algorithm.rollout_correction.preset=decoupled_token_icepop"], True),
        (["algorithm.rollout_correction.preset=decoupled_geo_rs_token_tis", "algorithm.entropy_coeff=0"], False),
        (["algorithm.rollout_correction.preset=decoupled_token_is"], False),
    ],
)
def test_a_rejecting_correction_with_an_entropy_bonus_needs_patch_0008(overrides, needs_0008, monkeypatch):
    """The backend refuses to start a run that rejects tokens and has an entropy bonus (or a KL loss) on a verl
    without patch 0008, naming it; a run that rejects nothing, or has neither term, does not need it."""
    from fully_async.config import compose
    from fully_async.training import verl_backend

    # The marker the check looks for is what patch 0008 adds to verl (applied here by the set-up script).
    verl_backend._require_patch(
        "0008-entropy-and-kl-over-kept-tokens", "verl.workers.utils.losses", "_kept_by_rollout_correction"
    )
    asked = []
    monkeypatch.setattr(verl_backend, "_require_patch", lambda name, module, marker: asked.append(name))
    algorithm = compose(["algorithm.entropy_coeff=0.1", *overrides]).algorithm
    verl_backend._require_patches(algorithm, use_reference=False, cpu=True)
    assert asked == (["0008-entropy-and-kl-over-kept-tokens"] if needs_0008 else [])


def test_switching_to_a_rejecting_algorithm_mid_run_checks_patch_0008_before_the_ranks_get_the_loss(monkeypatch):
    """VerlBackend.set_algorithm (the estimator or loss changed between updates) asks for patch 0008 as the build does,
    before anything reaches the ranks."""
    from fully_async.config import compose
    from fully_async.training import verl_backend

    def missing(name, module, marker):
        raise RuntimeError(f"verl patch patches/{name}.patch is not applied")

    monkeypatch.setattr(verl_backend, "_require_patch", missing)
    backend = object.__new__(verl_backend.VerlBackend)  # no ranks: the check must come first
    backend.cpu, backend.ranks = True, {}
    algorithm = compose(["algorithm.rollout_correction.preset=decoupled_geo_rs_token_tis"]).algorithm
    with pytest.raises(RuntimeError, match="0008-entropy-and-kl-over-kept-tokens"):
        backend.set_algorithm(algorithm)
