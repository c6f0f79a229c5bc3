"""A conversation as the prompt's token ids, the one way /v1/chat/completions and /tokenize
both take: the tools written in the server's format where the template does not render them
(serving/tools/prompt.py), then the chat template (the model's, or `--chat-template`'s)."""
from __future__ import annotations

from dataclasses import dataclass

from serving.tools.formats import ToolFormat
from serving.tools.prompt import template_messages


@dataclass(frozen=True)
class ChatPrompt:
    tokenizer: object                   # verifier/model/tokenizer.py:Tokenizer (or a copy with the server's template)
    tool_format: ToolFormat             # how the model writes tool calls (--tool-call-parser)
    special_tokens_in_content: bool     # parse `<|im_start|>` in messages as a token (unsafe)

    def ids(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = True,
            template_kwargs: dict | None = None) -> list[int]:
        """ValueError for a conversation the template refuses. Seconds for a long one: call it
        off the event loop."""
        turns, tools = template_messages(messages, tools, self.tool_format,
                                         getattr(self.tokenizer, "renders_tools", False))
        return self.tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt, tools=tools,
                                                  allow_special_tokens_in_content=self.special_tokens_in_content,
                                                  chat_template_kwargs=template_kwargs)
