"""Multi-turn episodes: tools, tool-call parsing, environments, and the rollout loop that continues engine requests
turn by turn (DESIGN.md, "Multi-turn rollouts")."""

from .environment import environment_tools
from .episode import ChatRenderer, Episode, TemplateError
from .loop import EpisodeConfig, MultiTurnRolloutLoop
from .parsing import ParsedTurn, parse_tool_calls
from .tools import ToolBox, ToolCall, ToolConfig, ToolResult, tool_schema

__all__ = ["ChatRenderer", "Episode", "EpisodeConfig", "MultiTurnRolloutLoop", "ParsedTurn", "TemplateError",
           "ToolBox", "ToolCall", "ToolConfig", "ToolResult", "environment_tools", "parse_tool_calls", "tool_schema"]
