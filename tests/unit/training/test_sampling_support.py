"""training/sampling_support.py: which runs take the trainer's log-probs under the rollout's top-k / nucleus, and
what goes into verl's batch."""

from __future__ import annotations

from fully_async.config.sections.rollout import RolloutConfig
from fully_async.engines import logprobs_truncated
from fully_async.training.batch import assemble, to_engine_td
from fully_async.training.sampling_support import SamplingSupport
from tests.training_data import make_groups


def test_the_engine_kind_decides_whether_the_trainer_truncates():
    rollout = RolloutConfig(top_p=0.8, top_k=20)
    # vLLM runs with --logprobs-mode processed_logprobs; SGLang returns the full softmax at the temperature.
    assert logprobs_truncated("vllm") and not logprobs_truncated("sglang") and not logprobs_truncated("sim")
    assert SamplingSupport.of_rollout(rollout, logprobs_truncated("vllm")) == SamplingSupport(top_k=20, top_p=0.8)
    assert not SamplingSupport.of_rollout(rollout, logprobs_truncated("sglang")).active


def test_only_an_active_support_goes_into_verls_batch():
    from verl.utils import tensordict_utils as tu

    batch = assemble(make_groups(2, 2, seed=3))
    off = to_engine_td(batch, 0.7, SamplingSupport().non_tensor())
    assert tu.get_non_tensor_data(off, "top_k", None) is None and tu.get_non_tensor_data(off, "top_p", None) is None
    on = to_engine_td(batch, 0.7, SamplingSupport(top_p=0.8).non_tensor())
    assert tu.get_non_tensor_data(on, "top_p", None) == 0.8 and tu.get_non_tensor_data(on, "top_k", None) == -1
    SamplingSupport(top_p=0.8).require_patch()  # patches/0007 is applied by the set-up script
