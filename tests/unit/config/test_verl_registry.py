"""The registry names read from verl's source equal verl's imported registries; reading them imports no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_names_read_from_the_source_equal_the_imported_registries():
    from verl.trainer.ppo import core_algos

    from fully_async.config.verl_registry import registered_names

    estimators, losses = registered_names()
    assert list(estimators) == list(core_algos.ADV_ESTIMATOR_REGISTRY)
    assert list(losses) == list(core_algos.POLICY_LOSS_REGISTRY)
    assert {"grpo", "rloo", "gae", "optimal_token_baseline"} <= set(estimators)
    assert {"vanilla", "gspo", "dro", "bypass_mode"} <= set(losses)


def test_validating_a_registry_name_imports_neither_torch_nor_verl():
    code = (
        "import sys; from fully_async.config import compose; "
        "cfg = compose(['algorithm.adv_estimator=rloo', 'algorithm.policy_loss=gspo']); "
        "assert cfg.algorithm.policy_loss == 'gspo'; "
        "assert not {'torch', 'verl'} & set(sys.modules), sorted({'torch', 'verl'} & set(sys.modules))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
