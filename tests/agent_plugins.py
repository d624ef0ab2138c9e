"""Agents written against the OpenAI client, for generate.strategy=agent (not a test module).
Each keeps the conversation its client saw in SEEN (keyed by the problem's id), so a test can
compare what was stored with it."""

from __future__ import annotations

import time

SEEN: dict[str, list[list[dict]]] = {}

TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name} two numbers written as a+b",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                   "required": ["expr"]}}} for name in ("add", "mul")]


def _run_tool(name: str, args: dict) -> str:
    try:
        a, b = (int(x) for x in str(args.get("expr", "")).replace("*", "+").split("+"))
    except ValueError:
        return "error: give a+b"
    return str(a + b if name == "add" else a * b)


def two_tools(problem, client):
    """Up to three model turns (of the server's default length: the run's
    generate.max_new_tokens); each tool call answered by its tool, a turn without one by a
    nudge. Reward 1 when the last turn holds the answer."""
    messages = [{"role": "user", "content": problem.prompt if isinstance(problem.prompt, str)
                 else problem.prompt[-1]["content"]}]
    text = ""
    for _ in range(3):
        r = client.chat.completions.create(model=client.model, messages=messages, tools=TOOLS)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True, include={"role", "content",
                                                                   "tool_calls"}))
        text = msg.content or ""
        if msg.tool_calls:
            for call in msg.tool_calls:
                import json
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": _run_tool(call.function.name,
                                                      json.loads(call.function.arguments))})
        else:
            messages.append({"role": "user", "content": "again"})
    SEEN.setdefault(problem.id, []).append(messages[:-1] if messages[-1]["role"] == "user"
                                           else messages)
    return 1.0 if str(problem.answer) in text else 0.0


def rewrites_history(problem, client):
    """Two calls; the second drops the first answer and asks anew: a rewrite, so two samples."""
    first = [{"role": "user", "content": "12+3="}]
    a = client.chat.completions.create(model=client.model, messages=first, max_tokens=6)
    second = [{"role": "user", "content": "12+3=" + (a.choices[0].message.content or "")[:1]}]
    client.chat.completions.create(model=client.model, messages=second, max_tokens=6)
    return 0.5


def final_answer(problem, client):
    """Returns the model's text as the final answer, for the run's own reward to score."""
    r = client.chat.completions.create(model=client.model, max_tokens=8,
                                       messages=[{"role": "user", "content": problem.prompt}])
    return r.choices[0].message.content or ""


def raises(problem, client):
    client.chat.completions.create(model=client.model, max_tokens=4,
                                   messages=[{"role": "user", "content": "1+1="}])
    raise RuntimeError("the agent's own bug")


def hangs(problem, client):
    client.chat.completions.create(model=client.model, max_tokens=4,
                                   messages=[{"role": "user", "content": "1+1="}])
    time.sleep(60)
    return 1.0
