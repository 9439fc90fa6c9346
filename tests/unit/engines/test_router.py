"""engine.router without a router process (fully_async/engines/router.py): the config key, the router's command line,
where generate requests go, and the refusal to front servers behind the auth proxy. The real router in front of real
SGLang servers: tests/integration/test_sglang_router.py."""

from __future__ import annotations

import pytest

from fully_async.config import ConfigError, EngineConfig, compose
from fully_async.engines import EngineError, build_engine
from fully_async.engines.auth import TOKEN_ENV
from fully_async.engines.router import SGLangRouter, _check_reachable


def test_router_is_off_by_default_and_only_fronts_sglang():
    assert compose([]).engine.router == "none"
    cfg = compose(["engine=sglang", "engine.router=sglang"]).engine
    assert cfg.router == "sglang" and cfg.router_policy == "cache_aware" and cfg.router_host == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"engine.router must be 'none' with engine.kind=vllm"):
        compose(["engine.router=sglang"])
    with pytest.raises(ConfigError, match=r"engine.router_policy"):
        compose(["engine=sglang", "engine.router=sglang", "engine.router_policy=fastest"])


def test_router_command_line_and_where_generate_requests_go(model, tmp_path, python):
    cfg = EngineConfig(kind="sglang", python=python, router="sglang", router_policy="round_robin", num_servers=2)
    pool = build_engine(cfg, model, tmp_path, device="cpu")
    assert pool.router is None and pool.generate_url(1) == pool.address(1)  # no router before start()
    router = pool.kind.make_router(tmp_path)
    assert isinstance(router, SGLangRouter)
    router._initial = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    cmd = router.command(4321)
    assert cmd[:3] == [python, "-m", "sglang_router.launch_router"]
    flag = {name: cmd[cmd.index(name) + 1] for name in ("--host", "--port", "--policy", "--log-level")}
    assert flag == {"--host": "127.0.0.1", "--port": "4321", "--policy": "round_robin", "--log-level": "warn"}
    assert cmd[cmd.index("--worker-urls") + 1 :][:2] == router._initial
    pool.router = router
    assert pool.generate_url(0) == pool.generate_url(1) == router.url != pool.address(0)
    assert pool.log_for(router.url).endswith("sglang-router.log")
    pool.slots.mark_stale(1)
    assert pool.routed_urls() == [pool.address(0)]  # a stale server (old weights) is out of the router
    assert (
        build_engine(EngineConfig(kind="sglang", python=python), model, tmp_path, device="cpu").kind.make_router(
            tmp_path
        )
        is None
    )


def test_servers_behind_the_auth_proxy_are_refused(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    _check_reachable(["http://10.0.0.5:8000"])  # no token: no proxies in the run
    monkeypatch.setenv(TOKEN_ENV, "t")
    _check_reachable(["http://127.0.0.1:8000", "http://localhost:9"])
    with pytest.raises(EngineError, match="10.0.0.5:8000 is on another node"):
        _check_reachable(["http://127.0.0.1:8000", "http://10.0.0.5:8000"])
