"""Agents: tool calls parsed from a model's turn (toolcalls), tools as typed Python functions
run with limits (tools), and the built-in tools (builtin_tools)."""

from rollwise.agents.toolcalls import ToolCall, detect, parse_tool_calls
from rollwise.agents.tools import Tool, Toolbox, ToolLimits

__all__ = ["Tool", "ToolCall", "ToolLimits", "Toolbox", "detect", "parse_tool_calls"]
