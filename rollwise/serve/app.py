"""The OpenAI-compatible endpoints over an engine: /v1/chat/completions, /v1/completions and
/v1/models, streaming (server-sent events) and not, under /v1 and under each agent episode's
own prefix /episodes/<token>/v1 (rollwise.serve.chat records what those calls produce).

Requests of every client and episode are batched by one engine driver (rollwise.serve.driver).
Tool calls are parsed from the model's turn in the format its chat template teaches
(rollwise.agents.toolcalls) and returned in OpenAI's format; the model is never forced to call
a tool ('required' and a named function only filter what it wrote). Bad requests get
OpenAI-style JSON errors: 400 (malformed, nested past MAX_JSON_DEPTH, not Unicode text, too
many messages, a context longer than the model's, a choice past the K/V budget), 401 (a
missing or wrong API key, where one is set), 404 (an unknown model or episode), 408 and 413
(a body too slow or too large: rollwise.serve.gate), 429 (the K/V queue full), 503 (nothing
serving). A non-streaming request whose client disconnects is cancelled (unless_gone), as a
stream is: its sequences are aborted at the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import ValidationError

from rollwise.engine import SamplingParams
from rollwise.serve.chat import Continued, TooLong, Turn
from rollwise.serve.gate import BODY_TIMEOUT_S, Gate
from rollwise.serve.protocol import (
    MAX_JSON_DEPTH,
    MAX_MESSAGES,
    MAX_PROMPTS,
    ApiError,
    ChatRequest,
    CompletionRequest,
    json_problem,
    usage,
)
from rollwise.serve.service import (
    Choice,
    EpisodeCalls,
    Policy,
    Service,
    choice_seed,
    run_choices,
)

MAX_BODY_BYTES = 16 << 20  # a request body past this is refused (413), declared or streamed


def build_app(service: Service, body_timeout_s: float = BODY_TIMEOUT_S) -> FastAPI:
    app = FastAPI(title="rollwise", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(ClientGone)
    async def _gone(request, e: ClientGone):  # nobody reads it: nginx's 499, closed
        return Response(status_code=499, headers={"connection": "close"})

    @app.exception_handler(Exception)
    async def _server_error(request, e: Exception):  # a bug here: said as JSON, not HTML
        return JSONResponse(ApiError(500, f"{type(e).__name__}: {e}", "internal_error",
                                     kind="server_error").body(), status_code=500)

    app.add_middleware(Gate, api_key=service.api_key, limit=MAX_BODY_BYTES,
                       body_timeout_s=body_timeout_s)
    for prefix in ("/v1", "/episodes/{episode}/v1"):
        app.get(prefix + "/models")(_models(service))
        app.post(prefix + "/chat/completions")(_chat(service))
        app.post(prefix + "/completions")(_completions(service))
    return app


def _models(service: Service):
    async def models(episode: str | None = None):
        return {"object": "list", "data": [{"id": service.model_name, "object": "model",
                                            "created": 0, "owned_by": "rollwise",
                                            "max_model_len": service.max_context}]}
    return models


async def _body(service: Service, request: Request, model):
    """The request's body as `model`, parsed and validated on the work thread."""
    return await service.off_loop(_parse, await request.body(), model)


def _parse(raw: bytes, model):
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the body is not JSON", "invalid_json") from None
    except RecursionError:
        raise ApiError(400, f"the body nests deeper than {MAX_JSON_DEPTH} levels",
                       "invalid_json") from None
    _check_counts(data)
    problem = json_problem(data)
    if problem is not None:
        raise ApiError(400, f"{problem[1] or 'body'}: {problem[0]}", "invalid_json",
                       problem[1] or None)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ApiError(400, f"{where}: {first['msg'].removeprefix('Value error, ')}",
                       "invalid_request", where) from None


def _check_counts(data) -> None:
    """Refuse a list of messages or prompts past its bound before pydantic validates each."""
    if not isinstance(data, dict):
        return
    for key, bound in (("messages", MAX_MESSAGES), ("prompt", MAX_PROMPTS)):
        items = data.get(key)
        if not isinstance(items, list) or len(items) <= bound:
            continue
        if key != "prompt" or not isinstance(items[0], int):  # token ids: one prompt
            raise ApiError(400, f"{key}: {len(items)} items, more than the {bound} one "
                           f"request may hold", "too_many_items", key)


def _checks(service: Service, req, episode: str | None) -> EpisodeCalls | None:
    if service.driver is None:
        raise ApiError(503, "the engine is not serving now", "not_serving",
                       kind="server_error")
    if req.model != service.model_name:
        raise ApiError(404, f"model {req.model!r} does not exist; this server serves "
                       f"{service.model_name!r}", "model_not_found", "model")
    if episode is None:
        return None
    ep = service.episodes.get(episode)
    if ep is None or not ep.open:
        raise ApiError(404, "this episode is over (it ended, failed or ran out of time)",
                       "episode_closed")
    return ep


def _budget(service: Service, prompt_len: int, asked: int | None) -> int:
    room = service.max_context - prompt_len
    if asked is not None and asked > room or room < 1:
        wants = f"max_tokens asks {asked} more" if asked else "no room is left for an answer"
        raise ApiError(400, f"this model's context is {service.max_context} tokens; the prompt "
                       f"has {prompt_len} and {wants}", "context_length_exceeded", "messages")
    return asked or min(room, service.default_max_tokens)


def _params(service: Service, req, max_new: int, top_logprobs: int, policy: Policy | None,
            seed: int | None = None) -> list[SamplingParams]:
    """Each choice's sampling: the client's settings, the round's policy over them inside an
    episode, and the choice's seed (choice_seed: from the client's seed, or the episode's)."""
    temperature = policy.temperature if policy and policy.temperature is not None \
        else req.temperature
    top_p = policy.top_p if policy and policy.top_p is not None else req.top_p
    return [SamplingParams(temperature=temperature, top_p=top_p,
                           top_k=policy.top_k if policy else 0, max_new_tokens=max_new,
                           stop_ids=service.stop_ids, top_logprobs=top_logprobs,
                           seed=choice_seed(seed, i),
                           event_every=1 if req.stop else 0) for i in range(req.n)]


def _chat(service: Service):
    async def chat(request: Request, episode: str | None = None):
        req = await _body(service, request, ChatRequest)
        ep = _checks(service, req, episode)
        messages = [m.plain() for m in req.messages]
        tools = None if req.tool_choice == "none" else req.tools
        service.check_prompt_chars(_chars(messages, tools), "messages")
        at = await service.off_loop(_chat_prompt, service, ep, messages, tools)
        max_new = _budget(service, len(at.prompt_ids),
                          req.max_completion_tokens or req.max_tokens)
        k = (req.top_logprobs or 0) if req.logprobs else 0
        seed = ep.next_seed(req.seed) if ep else req.seed
        params = _params(service, req, max_new, k, ep.policy if ep else None, seed)
        rid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        head = {"id": rid, "created": created, "model": service.model_name}

        def message(c: Choice) -> tuple[dict, str]:
            return _assistant(service, c, req, tools)

        def finished(choices: list[Choice]) -> None:
            if ep is not None and ep.open:
                for c in choices:
                    msg, _ = message(c)
                    turn = Turn(messages, tools, msg, at.prompt_ids, c.ids)
                    ep.transcript.record(at, turn, c.logprobs, c.versions, c.entropies)

        if not req.stream:
            choices = await unless_gone(request, run_choices(service, at.prompt_ids, params,
                                                             req.stop))
            finished(choices)
            out = []
            for c in choices:
                msg, reason = message(c)
                out.append({"index": c.index, "message": msg, "finish_reason": reason,
                            "logprobs": _chat_logprobs(service, c) if req.logprobs else None})
            return {**head, "object": "chat.completion", "choices": out,
                    "usage": usage(len(at.prompt_ids), sum(len(c.ids) for c in choices))}
        service.check_room(len(at.prompt_ids), params)
        return StreamingResponse(_chat_stream(service, req, at, params, head, tools, message,
                                              finished), media_type="text/event-stream")
    return chat


def _chars(messages: list[dict], tools) -> int:
    """The characters the prompt holds at least: contents, tool calls and tools."""
    return sum(len(m.get("content") or "") + (len(json.dumps(m["tool_calls"]))
                                              if m.get("tool_calls") else 0)
               for m in messages) + (len(json.dumps(tools)) if tools else 0)


def _chat_prompt(service: Service, ep: EpisodeCalls | None, messages, tools) -> Continued:
    try:
        return ep.transcript.prompt(messages, tools) if ep else \
            Continued(service.renderer.prompt_ids(messages, tools))
    except TemplateError as e:  # e.g. a template that wants roles to alternate
        raise ApiError(400, f"the chat template cannot render these messages: {e}",
                       "invalid_messages", "messages") from None
    except TooLong as e:
        raise ApiError(400, f"this model's context is {service.max_context} tokens; {e}, "
                       f"more than any {service.max_context} tokens can hold",
                       "context_length_exceeded", "messages") from None


def _assistant(service: Service, c: Choice, req: ChatRequest, tools) -> tuple[dict, str]:
    """The assistant message of a choice and its finish reason. Where the template renders
    tool calls itself, the content is the text around them; else it is the text as written,
    so the conversation sent back renders as the model wrote it."""
    calls = []
    if tools:
        _, parsed = service.renderer.answer(c.ids, service.stop_ids)
        wanted = (req.tool_choice or {}).get("function", {}).get("name") \
            if isinstance(req.tool_choice, dict) else None
        calls = [t for t in parsed if t.error is None and t.name and
                 (wanted is None or t.name == wanted)]
    content = c.text
    if calls and service.renderer.renders_tool_calls:
        content = _without_calls(c.text).strip() or None
    msg = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [{"id": f"call_{secrets.token_hex(8)}", "type": "function",
                              "function": {"name": t.name, "arguments": json.dumps(
                                  _arguments(t, tools))}} for t in calls]
    reason = "tool_calls" if calls and c.finish == "stop" else c.finish or "length"
    return msg, reason


def _without_calls(text: str) -> str:
    return re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.DOTALL)


def _arguments(call, tools) -> dict:
    """A call's arguments; the plain format's one positional argument goes to the tool's first
    parameter, as its schema names it."""
    if call.positional is None:
        return call.arguments if isinstance(call.arguments, dict) else {"input": call.arguments}
    for t in tools or []:
        f = t["function"]
        if f["name"] == call.name:
            names = list((f.get("parameters") or {}).get("properties", {}))
            return {names[0] if names else "input": call.positional}
    return {"input": call.positional}


def _chat_logprobs(service: Service, c: Choice) -> dict:
    tok = service.tokenizer
    n = len(c.ids) - (1 if c.ids and c.ids[-1] in service.stop_ids and c.finish == "stop"
                      else 0)

    def entry(t: int, lp: float) -> dict:
        s = tok.decode([t])
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]}
                        for t, lp, top in zip(c.ids[:n], c.logprobs[:n], c.top[:n])]}


async def _chat_stream(service, req, at, params, head, tools, message, finished):
    """Server-sent chunks: the role, then text as it comes (all at the end where tools may be
    called, since the text around a call is known only then), then the finish."""
    chunk = {**head, "object": "chat.completion.chunk"}

    async def produce(put):
        for i in range(len(params)):
            await put({**chunk, "choices": [{"index": i, "delta": {"role": "assistant",
                                                                    "content": ""},
                                             "finish_reason": None}]})

        async def on_delta(c: Choice) -> None:
            if not tools and len(c.text) > c.sent and not c.text.endswith("\ufffd"):
                await put({**chunk, "choices": [{"index": c.index, "delta": {
                    "content": c.text[c.sent:]}, "finish_reason": None}]})
                c.sent = len(c.text)

        choices = await run_choices(service, at.prompt_ids, params, req.stop, on_delta)
        finished(choices)
        for c in choices:
            msg, reason = message(c)
            delta = {}
            if tools and msg["content"]:
                delta["content"] = msg["content"]
            elif not tools and len(c.text) > c.sent:
                delta["content"] = c.text[c.sent:]
            if "tool_calls" in msg:
                delta["tool_calls"] = [{**t, "index": j} for j, t in
                                       enumerate(msg["tool_calls"])]
            await put({**chunk, "choices": [{
                "index": c.index, "delta": delta, "finish_reason": reason,
                "logprobs": _chat_logprobs(service, c) if req.logprobs else None}]})
    async for item in _events(produce):
        yield item


async def _events(produce):
    """Server-sent events from `produce(put)`, sent as they are put; an ApiError on the way
    becomes an error event; the stream ends with [DONE]."""
    queue: asyncio.Queue = asyncio.Queue()

    async def run():
        try:
            await produce(queue.put)
        except ApiError as e:
            await queue.put(e.body())
        finally:
            await queue.put(None)

    task = asyncio.create_task(run())
    try:
        while (item := await queue.get()) is not None:
            yield f"data: {json.dumps(item)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        task.cancel()  # the client went away: its requests are cancelled with the task


def _completions(service: Service):
    async def completions(request: Request, episode: str | None = None):
        req = await _body(service, request, CompletionRequest)
        _checks(service, req, episode)
        texts = [p for p in req.prompts() if isinstance(p, str)]
        service.check_prompt_chars(max(map(len, texts), default=0), "prompt")
        prompts = await service.off_loop(lambda: [
            p if isinstance(p, list) else service.tokenizer.encode(p) for p in req.prompts()])
        for ids in prompts:
            if not ids or any(not 0 <= t < len(service.tokenizer) for t in ids):
                raise ApiError(400, "a prompt is empty or holds token ids outside the "
                               "vocabulary", "invalid_prompt", "prompt")
        head = {"id": f"cmpl-{secrets.token_hex(12)}", "created": int(time.time()),
                "model": service.model_name, "object": "text_completion"}
        budgets = [_budget(service, len(ids), req.max_tokens) for ids in prompts]
        if req.stream:
            for ids, budget in zip(prompts, budgets):  # run one prompt at a time, as below
                service.check_room(len(ids), _params(service, req, budget, 0, None))
            return StreamingResponse(_completion_stream(service, req, prompts, budgets, head),
                                     media_type="text/event-stream")

        async def run() -> dict:
            out, used = [], 0
            for j, ids in enumerate(prompts):
                params = _params(service, req, budgets[j], req.logprobs or 0, None, req.seed)
                for c in await run_choices(service, ids, params, req.stop):
                    used += len(c.ids)
                    out.append(_text_choice(service, req, ids, c, j * req.n + c.index))
            return {**head, "choices": out,
                    "usage": usage(sum(map(len, prompts)) * req.n, used)}
        return await unless_gone(request, run())
    return completions


class ClientGone(Exception):
    """The client of a non-streaming request disconnected before its answer was ready."""


async def unless_gone(request: Request, work):
    """The result of the coroutine `work`, unless the client disconnects first: then `work` is
    cancelled (run_choices aborts its sequences at the engine's next step) and ClientGone
    raised, so a gone client's work stops instead of running to its end."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body was read whole: receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _text_choice(service, req, ids, c: Choice, index: int) -> dict:
    text = (service.tokenizer.decode(ids) if req.echo else "") + c.text
    lp = None
    if req.logprobs is not None:
        tok = service.tokenizer
        tokens = [tok.decode([t]) for t in c.ids]
        offsets, at = [], 0
        for s in tokens:
            offsets.append(at)
            at += len(s)
        lp = {"tokens": tokens, "token_logprobs": c.logprobs, "text_offset": offsets,
              "top_logprobs": [{tok.decode([a]): b for a, b in top} for top in c.top]}
    return {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish}


async def _completion_stream(service, req, prompts, budgets, head):
    async def produce(put):
        for j, ids in enumerate(prompts):
            async def on_delta(c: Choice, j=j) -> None:
                if len(c.text) > c.sent and not c.text.endswith("\ufffd"):
                    await put({**head, "choices": [{
                        "index": j * req.n + c.index, "text": c.text[c.sent:],
                        "logprobs": None, "finish_reason": None}]})
                    c.sent = len(c.text)
            params = _params(service, req, budgets[j], 0, None, req.seed)
            for c in await run_choices(service, ids, params, req.stop, on_delta):
                await put({**head, "choices": [{"index": j * req.n + c.index,
                                                "text": c.text[c.sent:], "logprobs": None,
                                                "finish_reason": c.finish}]})
    async for item in _events(produce):
        yield item
