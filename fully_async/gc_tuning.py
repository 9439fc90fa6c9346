"""Garbage-collector settings for the long-lived actor processes that handle every sample (Rollouter, MessageQueue).

Why: those processes hold tens of thousands of live containers (in-flight samples' tasks, futures and coroutines;
queued trajectories), and CPython's default young-generation threshold (700 allocations) runs a collection every
few samples, each promoting survivors that later full collections walk again. Almost none of it is garbage: the
rollout path makes few reference cycles, so collecting more rarely does not hold more memory. Measured on the
in-process rollout path (256 emulated engines, 16,384 samples in flight, the CPU of everything but Ray):
0.59 ms of CPU per sample with the defaults, 0.41 with a threshold of 10,000, 0.36 with 50,000, the same cycles
collected (2,967) and the same peak memory (855-927 MB). `gc.freeze()` after start-up moves the imported modules,
tokenizer and config out of every later collection.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000
"""Allocations of container objects between two young-generation collections (CPython's default: 700)."""


def tune_for_throughput() -> None:
    """Collect the young generation every YOUNG_THRESHOLD allocations (older generations keep their ratios) and
    exempt everything alive now from future collections (call it once start-up is done)."""
    _, older, oldest = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
