"""Wait until a Ray cluster has the expected alive nodes and declared GPUs (used by wait.sh; see its usage).

Polls the cluster's node table through the GCS (`ray.nodes()`): no fixed sleeps, one short interval between polls.
Exit 0 once there are at least --nodes alive nodes and --gpus GPUs on them (printing one line per node), 1 on timeout
with what was missing.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import time


def _summary(nodes: list[dict]) -> tuple[int, float, list[str]]:
    alive = [n for n in nodes if n.get("Alive")]
    gpus = sum(n["Resources"].get("GPU", 0.0) for n in alive)
    lines = [
        f"  node {n['NodeManagerAddress']} ({n['NodeID'][:8]}): "
        f"CPU {n['Resources'].get('CPU', 0):g}, GPU {n['Resources'].get('GPU', 0):g}"
        for n in alive
    ]
    return len(alive), gpus, lines


def _port_open(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--address", required=True, help="the GCS address IP:PORT")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus", type=float, default=0)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--interval", type=float, default=1.0)
    args = ap.parse_args()

    import ray

    deadline = time.monotonic() + args.timeout
    connected = False
    failed_connects = 0
    n_alive, gpus, lines = 0, 0.0, []
    while time.monotonic() < deadline:
        if not connected:
            # ray.init against an address where no GCS listens retries forever, past any timeout of ours: knock on
            # the port first and connect only once something accepts there.
            if not _port_open(args.address):
                if not failed_connects:
                    print(f"cluster: waiting for the head at {args.address} (nothing listens there yet)", flush=True)
                failed_connects += 1
                time.sleep(args.interval)
                continue
            try:
                ray.init(address=args.address, logging_level=logging.ERROR, log_to_driver=False,
                         configure_logging=False)  # fmt: skip
                connected = True
                if failed_connects:
                    print(f"cluster: reached the head after {failed_connects} failed attempts", flush=True)
            except (ConnectionError, RuntimeError) as e:
                # Deliberate: the head may still be starting (Slurm starts it in the background); retry until timeout.
                if not failed_connects:
                    print(f"cluster: waiting for the head at {args.address} ({type(e).__name__}: {e})", flush=True)
                failed_connects += 1
                time.sleep(args.interval)
                continue
        n_alive, gpus, lines = _summary(ray.nodes())
        if n_alive >= args.nodes and gpus >= args.gpus:
            print(f"cluster: ready: {n_alive} alive nodes, {gpus:g} GPUs", flush=True)
            print("\n".join(lines), flush=True)
            return 0
        time.sleep(args.interval)
    where = (
        "never reached the head"
        if not connected
        else f"{n_alive} of {args.nodes} nodes alive, {gpus:g} of {args.gpus:g} GPUs"
    )
    print(f"cluster: ERROR: timed out after {args.timeout:g}s waiting for {args.nodes} nodes and {args.gpus:g} GPUs at "
          f"{args.address}: {where}", file=sys.stderr, flush=True)  # fmt: skip
    if lines:
        print("\n".join(lines), file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
