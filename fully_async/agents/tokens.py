"""Token-in, token-out multi-turn trajectories: one growing token list, never re-rendered.

A multi-turn episode is the exact token sequence the engine consumed and produced: the prompt, then model turns
(loss mask 1, the engine's behaviour log-probs, the weight version of each token) interleaved with tokens the framework
inserted (tool responses, environment feedback, the chat template's turn boundaries: loss mask 0, version NO_VERSION,
log-prob 0). Every model call is sent `Transcript.ids`, so the trainer later scores exactly the sequence the policy saw.

Why not re-render the whole chat each turn: decoding model tokens to text and re-tokenizing them need not give the
same ids (merges across the boundary, templates that rewrite earlier assistant turns, such as Qwen3 dropping
`<think>` blocks), and then the trainer's log-probs are of a sequence the engine never sampled.

`ChatDelta` turns new messages (tool results, environment turns) into tokens by rendering them with the chat
template after a fixed prefix conversation and keeping only what the new messages added. The prefix ends with a user
turn, never an assistant turn, because templates render the last assistant turn differently from earlier ones.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fully_async.protocol import NO_VERSION, Trajectory

log = logging.getLogger(__name__)

PREFIX_MESSAGES = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hi."},
)
"""The fixed conversation new messages are rendered after (its tokens are cut off again); without the system turn
for templates that refuse one."""


def stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """End-of-turn tokens, the default stop set of generation: eos and, for chat templates with one, <|im_end|>."""
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return tuple(sorted(i for i in ids if i is not None))


class TemplateError(ValueError):
    """The chat template is not append-only for these messages: their tokens cannot be taken as a difference."""


def _ids(rendered: Any) -> list[int]:
    if isinstance(rendered, dict) or hasattr(rendered, "input_ids"):  # transformers 5 may return a BatchEncoding
        rendered = rendered["input_ids"]
    return [int(i) for i in rendered]


class ChatDelta:
    """Tokens that messages add to a conversation under a tokenizer's chat template.

    `delta(messages)` = render(PREFIX + messages, generation prompt) minus render(PREFIX), in token ids; so a tool
    turn's tokens include the template's header and the next assistant header (`<|im_start|>assistant\\n`).
    `boundary(last_token)` = the tokens the template places after an end-of-turn token and that the model did not
    generate (Qwen: the newline after `<|im_end|>`); when the model's turn did not end with the end-of-turn token
    (a stop id, a length cut) the end-of-turn token itself comes first.
    """

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        try:
            self.prefix = list(PREFIX_MESSAGES)
            self._prefix_text = self.render_text(self.prefix, add_generation_prompt=False)
        except Exception as e:  # jinja's raise_exception (e.g. "System role not supported"): try without it
            log.info("chat template refused a system turn (%s); tool turns are rendered after a user turn only", e)
            self.prefix = list(PREFIX_MESSAGES[1:])
            self._prefix_text = self.render_text(self.prefix, add_generation_prompt=False)
        self._prefix_ids = self.render_ids(self.prefix, add_generation_prompt=False)
        self.end_of_turn_id, after = self._end_of_turn()
        self._after_end = self.encode(after)

    # ---- rendering -------------------------------------------------------------------------------------------------
    def render_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool, **kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs, **kwargs
        )

    def render_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool, **kwargs: Any) -> list[int]:
        return _ids(
            self.tokenizer.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=add_generation_prompt, **self.template_kwargs, **kwargs
            )
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _end_of_turn(self) -> tuple[int, str]:
        """The template's end-of-turn token (the last special token of the prefix render) and the text after it."""
        text, ids = self._prefix_text, self._prefix_ids
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        special |= {
            i for i, t in getattr(self.tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", 0)
        }
        for tid in reversed(ids):
            if tid in special:
                token = self.tokenizer.convert_ids_to_tokens(tid)
                at = text.rfind(token)
                if at >= 0:
                    return tid, text[at + len(token) :]
        raise TemplateError("the chat template's render of a user turn holds no special end-of-turn token")

    # ---- differences -----------------------------------------------------------------------------------------------
    def delta(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids that `messages` (tool / user / environment turns) add after a finished turn, with the next
        assistant header when add_generation_prompt. Raises TemplateError when the template rewrites the prefix."""
        full = self.prefix + list(messages)
        ids = self.render_ids(full, add_generation_prompt=add_generation_prompt)
        n = len(self._prefix_ids)
        if ids[:n] == self._prefix_ids:
            return ids[n:]
        # Token ids can differ at the seam even when the text is append-only (a merge across it): cut the text.
        text = self.render_text(full, add_generation_prompt=add_generation_prompt)
        if not text.startswith(self._prefix_text):
            raise TemplateError(
                f"rendering {[m.get('role') for m in messages]} after a fixed prefix changed the prefix's text; "
                "this chat template is not append-only for these messages"
            )
        return self.encode(text[len(self._prefix_text) :])

    def boundary(self, last_token: int | None) -> list[int]:
        """Tokens to insert after a model turn ending with `last_token` so the sequence reads as the template renders
        a finished turn (see the class docstring)."""
        if last_token == self.end_of_turn_id:
            return list(self._after_end)
        return [self.end_of_turn_id, *self._after_end]


class Transcript:
    """The growing token list of one episode: the prompt, then model and inserted tokens with their per-token arrays."""

    def __init__(
        self, prompt_ids: Sequence[int], images: Sequence[bytes] = (), expanded_prompt: Sequence[int] | None = None
    ):
        """`images`: the prompt's (a vision-language model); `prompt_ids` then holds one image token per image (what
        the engine is sent) and `expanded_prompt` each expanded to its patch tokens (what the trainer scores)."""
        self.engine_ids = list(prompt_ids)
        """The engine's view of the whole sequence: one image token per image (the engine expands them itself)."""
        self.prompt_ids = list(prompt_ids if expanded_prompt is None else expanded_prompt)
        self.response_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.cache_versions: list[int] = []
        """Per response token, the oldest weights in its KV cache (async_training.on_sync=keep; else = versions)."""
        self.mask: list[int] = []
        self.images: list[bytes] = list(images)
        """Every image of the episode so far, in the order of their image tokens."""

    @property
    def ids(self) -> list[int]:
        """What the next model call is sent: prompt + everything so far (images: one token each)."""
        return list(self.engine_ids)

    def __len__(self) -> int:
        """Response tokens so far (model and inserted): what the response budget counts."""
        return len(self.response_ids)

    @property
    def last_token(self) -> int | None:
        return self.response_ids[-1] if self.response_ids else None

    def add_model(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int],
        cache_versions: Sequence[int] | None = None,
    ) -> None:
        """Tokens the policy sampled: trained on (mask 1), with their behaviour log-probs and weight versions (and
        their KV cache's, `GenerationResult.cache_versions`, where the engine kept one across a sync)."""
        cache = versions if cache_versions is None else cache_versions
        if not len(token_ids) == len(logprobs) == len(versions) == len(cache):
            raise ValueError(f"{len(token_ids)} tokens, {len(logprobs)} log-probs, {len(versions)} versions, "
                             f"{len(cache)} cache versions")  # fmt: skip
        self.engine_ids.extend(int(t) for t in token_ids)
        self.response_ids.extend(int(t) for t in token_ids)
        self.logprobs.extend(float(x) for x in logprobs)
        self.versions.extend(int(v) for v in versions)
        self.cache_versions.extend(int(v) for v in cache)
        self.mask.extend([1] * len(token_ids))

    def add_inserted(
        self, token_ids: Sequence[int], images: Sequence[bytes] = (), expanded: Sequence[int] | None = None
    ) -> None:
        """Tokens no policy produced (tool output, environment text, template boundaries): mask 0, NO_VERSION. With
        `images` (a tool that returned images), `token_ids` is the engine's view (one image token each) and
        `expanded` the trainer's (agents/tool_images.py); the images join the episode's, in order."""
        self.engine_ids.extend(int(t) for t in token_ids)
        kept = token_ids if expanded is None else expanded
        self.response_ids.extend(int(t) for t in kept)
        self.logprobs.extend([0.0] * len(kept))
        self.versions.extend([NO_VERSION] * len(kept))
        self.cache_versions.extend([NO_VERSION] * len(kept))
        self.mask.extend([0] * len(kept))
        self.images.extend(images)

    def to_trajectory(self, **fields: Any) -> Trajectory:
        """The episode as a Trajectory (prompt, sample_index, start_version, ... given as `fields`)."""
        return Trajectory(
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            behaviour_logprobs=self.logprobs,
            token_versions=self.versions,
            cache_versions=self.cache_versions if self.cache_versions != self.versions else None,
            loss_mask=self.mask,
            images=list(self.images),
            **fields,
        )
