"""Serve an OpenEnv app on loopback: `python -m fully_async.envs.serve pkg.mod:app --port N [--host 127.0.0.1]`.
What the pool launches (pool.py) under the engine servers' watchdog."""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("app", help="dotted path 'pkg.mod:app' of an ASGI app (openenv's create_app)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    from fully_async.envs import require
    from fully_async.plugins import load

    uvicorn = require("uvicorn", "openenv-core")
    require("openenv.core", "openenv-core")
    uvicorn.run(load(args.app, "rollout.multi_turn.env.app"), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
