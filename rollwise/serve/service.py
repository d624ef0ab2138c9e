"""What the endpoints serve (rollwise.serve.app): the engine through its driver, the
tokenizer's rendering, limits, the API key and the open agent episodes; and one request's
choices run on the engine, each choice's text cut at its first stop string.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

from rollwise.engine import SamplingParams
from rollwise.engine.scheduler import LEN_ALIGN
from rollwise.serve.chat import Renderer, Transcript
from rollwise.serve.driver import EngineStopped, RequestRefused
from rollwise.serve.protocol import ApiError


@dataclass
class Policy:
    """Sampling a training round imposes on its episodes' calls (the policy being trained):
    temperature, top_p and top_k replace the client's; None leaves the client's."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0


QUEUED_BUDGETS = 4  # K/V positions served or waiting, in budgets, before requests get 429
WORK_THREADS = 4  # bodies prepared at once (parse, render, tokenize)
SEED_STRIDE = 1_000  # an episode's calls' seeds are this far apart


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of a request's choice `index`: choice 0 samples as a request with n=1 and the
    same seed; the others get seeds hashed from (seed, index), so that no choice of one seed
    repeats a choice of another (seed + index would make seed s's choice 1 seed s+1's 0)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (1 << 63)


@dataclass
class EpisodeCalls:
    """An agent episode's calls, as the server sees them."""
    transcript: Transcript
    policy: Policy = field(default_factory=Policy)
    open: bool = True
    calls: int = 0
    seed: int | None = None  # its calls' seeds, where the client gives none: seed + SEED_STRIDE
    # x (the call's index) + (the choice's): its samples do not depend on when its calls came

    def next_seed(self, client_seed: int | None) -> int | None:
        """The seed of this episode's next call (its choices add their index to it)."""
        self.calls += 1
        if client_seed is not None or self.seed is None:
            return client_seed
        return self.seed + SEED_STRIDE * (self.calls - 1)


class Service:
    """What the endpoints serve: the engine (through a driver, which may come and go between
    training rounds), the tokenizer's rendering, limits, the API key and the open episodes."""

    def __init__(self, tokenizer, model_name: str, max_context: int, stop_ids,
                 api_key: str | None = None, request_timeout_s: float = 600.0,
                 default_max_tokens: int = 256, kv_budget_tokens: int | None = None):
        """kv_budget_tokens: the engine's K/V budget (the engine must be built with it): a
        choice that cannot fit it is refused (400), and requests are queued for it up to
        QUEUED_BUDGETS budgets of positions, past which they get 429. None: no bound."""
        self.max_prompt_chars = max_context * longest_token_chars(tokenizer)
        self.renderer = Renderer(tokenizer, self.max_prompt_chars)
        self.tokenizer, self.model_name, self.max_context = tokenizer, model_name, max_context
        self.stop_ids = tuple(stop_ids)
        self.api_key, self.timeout_s = api_key, request_timeout_s
        self.default_max_tokens = default_max_tokens
        self.kv_budget_tokens = kv_budget_tokens
        self.reserved = 0  # K/V positions the requests being served or queued may take
        self.driver = None
        self.episodes: dict[str, EpisodeCalls] = {}
        # parsing, rendering and tokenizing a body take up to seconds: threads do them, so the
        # event loop (every other client, streams, /v1/models) never waits on them, and
        # several, so one large body's preparation does not hold the next client's
        self.work = ThreadPoolExecutor(WORK_THREADS, thread_name_prefix="rollwise-serve-work")

    async def off_loop(self, fn, *args):
        """fn(*args) on the service's work thread."""
        return await asyncio.get_running_loop().run_in_executor(self.work, fn, *args)

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing, a prompt that cannot fit the context whatever its text:
        no token covers more than the vocabulary's longest entry."""
        if chars > self.max_prompt_chars:
            raise ApiError(400, f"this model's context is {self.max_context} tokens; the "
                           f"prompt has {chars} characters, more than any {self.max_context} "
                           f"tokens can hold", "context_length_exceeded", param)

    def check_room(self, prompt_len: int, params: list[SamplingParams]) -> None:
        """Refuse a request the K/V budget cannot take: 400 where one choice cannot fit it,
        429 where the queue is full. Called before a stream begins too, so that a streamed
        request gets its status rather than an error event after a 200."""
        budget = self.kv_budget_tokens
        if budget is None:
            return
        each = [prompt_len + p.max_new_tokens for p in params]
        if -(-max(each) // LEN_ALIGN) * LEN_ALIGN > budget:
            raise ApiError(400, f"one choice needs {max(each)} K/V positions (the prompt's "
                           f"{prompt_len} + max_tokens {max(each) - prompt_len}); this "
                           f"server's K/V budget holds {budget}: lower max_tokens",
                           "kv_budget_exceeded", "max_tokens")
        if self.reserved and self.reserved + sum(each) > QUEUED_BUDGETS * budget:
            raise ApiError(429, f"the server is busy: {self.reserved} K/V positions are "
                           f"running or queued, and this request's {sum(each)} would pass "
                           f"{QUEUED_BUDGETS}x its budget of {budget}; retry later",
                           "busy", kind="rate_limit_error", headers={"retry-after": "2"})

    @contextmanager
    def reserving(self, prompt_len: int, params: list[SamplingParams]):
        """Hold a request's K/V positions while it runs (on the event loop: no lock), or
        refuse it (check_room)."""
        self.check_room(prompt_len, params)
        need = sum(prompt_len + p.max_new_tokens for p in params)
        self.reserved += need
        try:
            yield
        finally:
            self.reserved -= need

    def open_episode(self, policy: Policy | None = None, seed: int | None = None) -> str:
        token = secrets.token_urlsafe(16)
        self.episodes[token] = EpisodeCalls(Transcript(self.renderer), policy or Policy(),
                                            seed=seed)
        return token

    def close_episode(self, token: str) -> EpisodeCalls:
        ep = self.episodes.pop(token)
        ep.open = False
        return ep


def longest_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token decodes to: the longest vocabulary entry
    (byte-level and sentencepiece entries spell one byte or character per character)."""
    vocab = getattr(tokenizer, "get_vocab", None)
    entries = vocab().keys() if callable(vocab) else ()
    return max(max(map(len, entries), default=0), 1) if entries else 1 << 10


@dataclass
class Choice:
    """One choice's tokens as its events come, and its text so far."""
    index: int
    stops: list[str]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    top: list = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of text already streamed
    finish: str | None = None


async def run_choices(service: Service, prompt_ids: list[int], params: list[SamplingParams],
                      stops: list[str], on_delta=None) -> list[Choice]:
    """The engine's answers to one request (a choice per params), each choice's text cut at
    its first stop string; on_delta(choice) after each event with new text."""
    with service.reserving(len(prompt_ids), params):
        return await _run_choices(service, prompt_ids, params, stops, on_delta)


async def _run_choices(service, prompt_ids, params, stops, on_delta) -> list[Choice]:
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    choices = [Choice(i, stops) for i in range(len(params))]
    streams = []
    try:
        for i, p in enumerate(params):
            streams.append(service.driver.submit(
                prompt_ids, p, tag=i,
                on_event=lambda ev, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, ev))))
    except EngineStopped as e:
        raise ApiError(503, str(e), "not_serving", kind="server_error") from None
    pending = len(streams)
    try:
        while pending:
            try:  # not wait_for: on 3.11 it drops a cancel that meets an event (a gone client)
                async with asyncio.timeout(service.timeout_s):
                    i, ev = await events.get()
            except TimeoutError:
                raise ApiError(504, f"the engine sent nothing for {service.timeout_s:.0f}s",
                               "timeout", kind="server_error") from None
            if isinstance(ev, RequestRefused):
                raise ApiError(400, str(ev), "kv_budget_exceeded", "max_tokens")
            if isinstance(ev, BaseException):
                raise ApiError(503, str(ev), "not_serving", kind="server_error")
            c = choices[i]
            if c.finish is None:
                _take(service, c, ev, streams[i])
                if on_delta is not None:
                    await on_delta(c)
            pending -= ev.finished
    finally:
        for s in streams:
            s.cancel()  # a client that went away (or a stop string met) frees its sequences
    return choices


def _take(service: Service, c: Choice, ev, stream) -> None:
    c.ids += ev.token_ids
    c.logprobs += ev.logprobs
    c.versions += ev.versions
    c.entropies += ev.entropies
    c.top += ev.top_logprobs or [[] for _ in ev.token_ids]
    ids = c.ids[:-1] if ev.finished and c.ids and c.ids[-1] in service.stop_ids else c.ids
    text = service.tokenizer.decode(ids, skip_special_tokens=True)
    hit = min((text.find(s) for s in c.stops if s in text), default=-1)
    if hit >= 0:
        c.text, c.finish = text[:hit], "stop"
        stream.cancel()
        return
    c.text = text
    if ev.finished:
        c.finish = "stop" if ev.finish_reason == "stop" else "length"
