"""The console of a run with real Ray workers: two training-rank processes import verl (its engine-availability
warnings, which stay off the console) and the real engine client retries against two dead engines; the console shows
each kind of line once plus a count, RUN_DIR/logs/workers.log has every line."""

from __future__ import annotations

import time

import pytest
import ray

from fully_async import console

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # two processes import verl: ~40-70 s here

RETRIES = 20
DEAD = ["http://127.0.0.1:9", "http://127.0.0.1:7"]  # nothing listens there: every request fails at once


@ray.remote(num_cpus=0)
class Rank:
    def ready(self) -> bool:
        import verl.workers.engine  # noqa: F401  (what every training rank imports: warns once per missing engine)

        return True


@ray.remote(num_cpus=0)
class Dialer:
    async def dial(self) -> str:
        from fully_async.config import EngineConfig
        from fully_async.engines import EngineClient, EngineError, build_engine

        cfg = EngineConfig(control_timeout_s=5.0, max_retries=RETRIES)
        client = EngineClient(build_engine(cfg, "/nonexistent", "/tmp", addresses=DEAD))
        try:
            await client.generate([1], 4)
        except EngineError as e:
            return str(e).splitlines()[0]
        finally:
            await client.close()
        return "no error"


def test_worker_warnings_and_a_retry_storm_show_once_each_with_counts(ray_local, tmp_path, capfd):
    sink = console.install(tmp_path, report_every_s=1e9)
    assert sink is not None
    log_file = tmp_path / "logs" / "workers.log"
    ranks = [Rank.remote() for _ in range(2)]
    dialer = Dialer.remote()
    try:
        dialed = dialer.dial.remote()  # the retry storm while the ranks import verl
        assert ray.get([r.ready.remote() for r in ranks], timeout=180) == [True, True]
        assert "generate failed" in ray.get(dialed, timeout=120)
        deadline = time.monotonic() + 30  # Ray forwards worker output asynchronously
        want = RETRIES  # the last failure raises instead of retrying
        while time.monotonic() < deadline:
            text = log_file.read_text()
            if (
                text.count("retrying a request") >= want
                and text.count("UserWarning: megatron engine is not available") >= 2
            ):
                break
            time.sleep(0.5)
    finally:
        for a in (*ranks, dialer):
            ray.kill(a)
        console.uninstall()
    text = log_file.read_text()
    assert text.count("retrying a request") == want
    assert text.count("UserWarning: megatron engine is not available") == 2  # once per rank: the file keeps them all
    shown = capfd.readouterr()
    screen = (shown.out + shown.err).splitlines()
    retry_lines = [line for line in screen if "retrying a request" in line]
    # Per engine: its first line, then one count line at the close.
    for url in DEAD:
        mine = [line for line in retry_lines if f"{url}:" in line]
        assert len(mine) == 2, mine
        assert "more like this" not in mine[0] and "more like this" in mine[1]
    counts = [int(line.split("[")[1].split()[0]) for line in retry_lines if "more like this" in line]
    assert sum(counts) + len(DEAD) == want
    # verl's import-time chatter is in the file only (console.QUIET): a run's console holds our lines
    assert not [line for line in screen if "engine is not available" in line or "warnings.warn(" in line]
