"""A server set aside whose engine host does not answer: is its host alive (restart the server in place) or gone
(replace it on a new host)?

A killed node answers at once (Ray reports its actors dead). A hung one (SIGSTOP, a GPU stuck in a kernel, a node
swapping, an NFS stall) does not answer at all, and Ray declares its node dead only after its own health checks give
up (about a minute with Ray's defaults, minutes on a real cluster), or never, when only the host's process hangs.
So the host is asked within engine.control_deadline_s, again and again, until one of:

- it answers: the node continued (SIGCONT) or the stall ended; the server is restarted in place;
- it is reported dead, or Ray reports its node dead: the server is replaced on a new host;
- engine.hung_host_s passed since the first unanswered question: "hung"; the server is replaced all the same, on
  another node where the cluster has one (Ray still counts the hung node's resources as free); the hung host is
  killed (Ray kills it for good once its node answers or is declared dead).

Each question is bounded, so one wait is bounded by engine.hung_host_s plus one deadline; the caller (elastic.py
`relaunch`, from recovery.py's restart loop) runs it in a thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Literal

logger = logging.getLogger(__name__)

Verdict = Literal["alive", "gone", "hung"]

POLL_S = 1.0
"""Pause between two questions to a host that did not answer (each question already waited up to the deadline)."""


def wait_for_host(
    proc: Any,
    node_dead: Callable[[], bool],
    deadline_s: float,
    hung_host_s: float,
    closed: Callable[[], bool] = lambda: False,
    clock: Callable[[], float] = time.monotonic,
    poll_s: float = POLL_S,
) -> Verdict:
    """Whether the engine host of `proc` (a `RemoteServer`) is alive, gone, or hung past `hung_host_s` (see the module
    docstring). `node_dead()`: Ray reports the host's node dead. `closed()`: the pool is stopping (the
    wait ends as gone: nothing is to be restarted)."""
    first_silence: float | None = None
    while True:
        answer = proc.host_answers(deadline_s)
        if answer is not None:
            if first_silence is not None:
                logger.warning("engine host of %s answers again after %.1f s; its server is restarted in place",
                               proc.url, clock() - first_silence)  # fmt: skip
            return "alive" if answer else "gone"
        now = clock()
        if first_silence is None:
            first_silence = now
            logger.warning("engine host of %s does not answer within engine.control_deadline_s=%g s (its node hung?); "
                           "waiting up to engine.hung_host_s=%g s for it or for Ray to declare its node dead",
                           proc.url, deadline_s, hung_host_s)  # fmt: skip
        if node_dead():
            logger.warning("engine host of %s: Ray declared its node dead after %.1f s without an answer; replacing "
                           "its server", proc.url, now - first_silence)  # fmt: skip
            return "gone"
        if now - first_silence >= hung_host_s:
            logger.warning("engine host of %s has not answered for engine.hung_host_s=%g s and Ray still reports its "
                           "node alive; replacing its server", proc.url, hung_host_s)  # fmt: skip
            return "hung"
        if closed():
            return "gone"
        time.sleep(poll_s)
