"""An agent written against the OpenAI client, trained by rollwise (generate.strategy=agent)."""
import json

from rollwise.agents.builtin_tools import calculator

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}]


def solve(problem, client):
    """problem.prompt: the question; client: an openai.OpenAI for this episode alone."""
    messages = [{"role": "user", "content": problem.prompt}]
    for _ in range(3):
        msg = client.chat.completions.create(model=client.model, messages=messages,
                                             tools=TOOLS).choices[0].message
        messages.append(msg.model_dump(include={"role", "content", "tool_calls"}))
        if not msg.tool_calls:
            return msg.content or ""  # the final answer, scored by filter.reward
        for call in msg.tool_calls:
            expression = json.loads(call.function.arguments).get("expression", "")
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculator(expression)})
    return ""
