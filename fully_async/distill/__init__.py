"""On-policy distillation (docs/distillation.md): a teacher served beside the student scores every sampled token,
hidden behind generation like the reward.

Rooms: `teacher.py` (the teacher's own engine servers, or a server the run does not own; `start_teacher`),
`scorer.py` (TeacherScorer: one request per row, prompt + response, under the reward path's limits, timeouts and
retries; a failure re-issues the group, never becomes a signal), `checks.py` (before Ray: the teacher's tokenizer
against the student's, prompt log-probs). The loss is the training backend's (fully_async/training/distill_loss.py).

`score_sample(reward, rows, text, meta)` is production's one call per finished sample: the reward and, when the
RewardAgent carries a teacher (`RewardAgent.teacher`, set by the Rollouter), the teacher's scores, concurrently.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from fully_async.distill.scorer import TeacherFailed, TeacherScorer
from fully_async.distill.teacher import Teacher, start_teacher

__all__ = ["Teacher", "TeacherFailed", "TeacherScorer", "score_sample", "start_teacher"]


async def score_sample(reward: Any, rows: Sequence[Any], text: str, meta: dict[str, Any]) -> Any:
    """`reward.score(text, meta)`'s result, with every row's teacher log-probs set when `reward.teacher` is set. Both
    run at once; when either fails the other is cancelled (and awaited) before the error propagates, so a re-issued
    group leaves nothing of its last attempt running."""
    teacher = getattr(reward, "teacher", None)
    if teacher is None:
        return await reward.score(text, meta)
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(reward.score(text, meta)), loop.create_task(teacher.score(rows))]
    try:
        result, _ = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return result
