"""A request's choices: ``n`` continuations of each prompt (and each prompt of a completions list), every one a
:class:`Generation` of its own, run together and merged into one stream of ``(choice, delta)``.

Prefill once: each prompt's first choice (its *leader*) starts alone; the others start when the leader's first
delta arrives, i.e. once P has computed the prompt. Their prefill then finds the prompt in P's prefix cache (the
conductor places a prompt where its blocks are), and D's prefix cache holds it after the leader's read, so D
reads it once. With greedy sampling every choice equals one worker's output; with ``seed`` choice i is sent
``seed + i``, as vLLM seeds its n children.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from ..api.logprobs import LogprobTrack
from ..api.tools import ToolCalls
from .delta import Delta
from .generation import Generation

_INT64_MAX = 2 ** 63 - 1


def choice_seed(seed: int, index: int) -> int:
    """vLLM's child seed: ``seed + index`` (kept inside int64)."""
    return min(seed + index, _INT64_MAX)


@dataclass
class Choice:
    """One choice's run and what it has produced so far."""

    index: int
    prompt: int  # which prompt (completions lists), 0 otherwise
    gen: Generation
    prompt_ids: list[int]
    prompt_text: str  # completions: for echo; chat: the rendered prompt with return_prompt_text
    track: LogprobTrack | None = None
    parts: list[str] = field(default_factory=list)
    started: bool = False  # a chunk has gone out (stream): echo and prompt ids go with the first
    tokens: int = 0
    tools: ToolCalls | None = None  # chat with tools: this choice's parser state

    @property
    def text(self) -> str:
        return "".join(self.parts)


async def merged(choices: list[Choice]) -> AsyncGenerator[tuple[Choice, Delta], None]:
    """Run the choices (followers after their leader's first delta) and yield their deltas as they come.
    The first error of any choice is raised; leaving early (client gone, error) closes every run, so the
    workers abort and every ticket is closed."""
    if len(choices) == 1:
        c = choices[0]
        async with aclosing(c.gen.run()) as deltas:
            async for one in deltas:
                yield c, one
        return
    queue: asyncio.Queue[tuple[Choice, Delta | None, BaseException | None]] = asyncio.Queue()
    tasks: list[asyncio.Task] = []

    async def pump(c: Choice) -> None:
        try:
            async with aclosing(c.gen.run()) as deltas:
                async for d in deltas:
                    await queue.put((c, d, None))
            await queue.put((c, None, None))
        except Exception as e:  # handed to the consumer, which raises it
            await queue.put((c, None, e))

    followers: dict[int, list[Choice]] = {}
    for c in choices:
        followers.setdefault(c.prompt, []).append(c)
    waiting = {group[0].index: group[1:] for group in followers.values()}
    start: Callable[[Choice], None] = lambda c: tasks.append(asyncio.create_task(pump(c)))  # noqa: E731
    for group in followers.values():
        start(group[0])
    live = len(choices)
    try:
        while live:
            c, d, err = await queue.get()
            for f in waiting.pop(c.index, ()):
                start(f)
            if err is not None:
                raise err
            if d is None:
                live -= 1
                continue
            yield c, d
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sum_usage(choices: list[Choice]) -> tuple[int, int]:
    """(prompt tokens, counted once per prompt as vLLM does; completion tokens of all choices)."""
    prompts: dict[int, int] = {}
    for c in choices:
        prompts[c.prompt] = len(c.prompt_ids)
    return sum(prompts.values()), sum(len(c.gen.token_ids) for c in choices)


def echo_prefix(c: Choice, return_token_ids: bool) -> str:
    """The text echo puts before the output: the prompt, or "" when token ids are returned (as vLLM)."""
    return "" if return_token_ids else c.prompt_text
