"""A response's output items, built from its one choice's chat deltas, and the events that
build them (OpenAI's Responses streaming events, `sequence_number` added by the stream).

The chat deltas (serving/deltas.py:ChoiceDeltas) carry `reasoning_content`, `content`, and with
tools the call parser's `tool_calls`; each kind of delta writes into an item of its kind, and a
delta of another kind (or another call) closes the open item and opens the next: reasoning
(`rs_`), an assistant message (`msg_`), a function call (`fc_`, its `call_id` the parser's). A
whole response is built by the same code with its events dropped, so a streamed response and a
whole one always agree. A reply with no item at all gets one empty message (its text is "").
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from serving.protocol import tercel_stats
from spec.request import RequestOutput

ITEM_PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


def item_id(kind: str) -> str:
    return f"{ITEM_PREFIX[kind]}_{uuid.uuid4().hex}"


@dataclass
class OutputItems:
    """The output so far; `feed` a chat choices entry, `finish` at the end; each returns its events."""
    items: list[dict] = field(default_factory=list)
    _open: dict | None = field(default=None, init=False)     # the item being written
    _calls: dict[int, dict] = field(default_factory=dict, init=False)   # the parser's call index -> its item

    def feed(self, entry: dict) -> list[dict]:
        delta, events = entry.get("delta") or {}, []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        return events

    def finish(self, complete: bool) -> list[dict]:
        """Close the open item (`incomplete` when the reply was cut short); an empty message if none."""
        events = [] if self.items else self._open_item("message")
        return events + self._close("completed" if complete else "incomplete")

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events = self._close("completed") + self._open_item(kind)
        item = self._open
        item["content"][0]["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [{"type": name, **self._where(item), "content_index": 0, "delta": text, **extra}]

    def _call(self, call: dict) -> list[dict]:
        events = []
        if "id" in call:                       # a call starts: its name is complete
            events = self._close("completed") + self._open_item("function_call", call_id=call["id"],
                                                                name=call["function"]["name"])
            self._calls[call["index"]] = self._open
        item = self._calls[call["index"]]
        args = call["function"].get("arguments") or ""
        if args:
            item["arguments"] += args
            events.append({"type": "response.function_call_arguments.delta", **self._where(item), "delta": args})
        return events

    def _open_item(self, kind: str, **fields) -> list[dict]:
        item = new_item(kind, **fields)
        self.items.append(item)
        self._open = item
        events = [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": _copy(item)}]
        if kind != "function_call":
            events.append({"type": "response.content_part.added", **self._where(item), "content_index": 0,
                           "part": _copy(item["content"][0])})
        return events

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        where = self._where(item)
        if item["type"] == "function_call":
            events = [{"type": "response.function_call_arguments.done", **where, "name": item["name"],
                       "arguments": item["arguments"]}]
        else:
            part = item["content"][0]
            done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events = [{"type": done, **where, "content_index": 0, "text": part["text"], **extra},
                      {"type": "response.content_part.done", **where, "content_index": 0, "part": _copy(part)}]
        return events + [{"type": "response.output_item.done", "output_index": where["output_index"],
                          "item": _copy(item)}]

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": next(i for i, x in enumerate(self.items) if x is item)}


def new_item(kind: str, **fields) -> dict:
    base = {"type": kind, "id": item_id(kind), "status": "in_progress"}
    if kind == "message":
        return {**base, "role": "assistant",
                "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
    if kind == "reasoning":
        return {**base, "summary": [], "content": [{"type": "reasoning_text", "text": ""}]}
    return {**base, "call_id": fields["call_id"], "name": fields["name"], "arguments": ""}


def _copy(item: dict) -> dict:
    """A snapshot for an event: the item goes on changing after it is sent."""
    return {k: ([dict(p) for p in v] if k == "content" else v) for k, v in item.items()}


def output_messages(items: list[dict]) -> tuple[dict, ...]:
    """The output as the chat turn a client would send back: the text, then the calls (reasoning
    left out, as templates drop it from earlier turns)."""
    text = "".join(i["content"][0]["text"] for i in items if i["type"] == "message")
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    turn = {"role": "assistant", "content": text if text or not calls else None}
    return ({**turn, "tool_calls": calls} if calls else turn),


# ---- the response object ----------------------------------------------------------------------
@dataclass(frozen=True)
class ResponseHead:
    """What the response object says besides its status, output and usage: its id, and the
    request's settings as OpenAI's object echoes them."""
    id: str
    created_at: int
    model: str
    settings: dict          # instructions, max_output_tokens, temperature, tools, ... (`settings` below)

    def body(self, status: str, output: list[dict], usage: dict | None = None, **extra) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": None,
                "incomplete_details": None, "model": self.model, "output": output, "usage": usage, **self.settings,
                **extra}


def settings(body, params, history: bool) -> dict:
    """`body`: the ResponsesRequest; `params`: the SamplingParams it was given (defaults applied)."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    return {"instructions": body.instructions, "previous_response_id": body.previous_response_id if history else None,
            "max_output_tokens": body.max_output_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "tools": [t.model_dump(by_alias=True) for t in body.tools or ()],
            "tool_choice": _tool_choice(body), "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "truncation": "disabled", "store": body.store is not False, "background": False,
            "metadata": body.metadata or {}, "user": body.user}


def _tool_choice(body):
    choice = body.tool_choice
    if choice is None:
        return "auto" if body.tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()


def final_body(head: ResponseHead, items: OutputItems, out: RequestOutput, prompt_tokens: int,
               reasoning_tokens: int, completed_at: int) -> dict:
    """The finished response: `completed`, or `incomplete` when it ended at max_output_tokens
    (or the context's end) or was aborted."""
    usage = {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
             "output_tokens": len(out.token_ids), "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
             "total_tokens": prompt_tokens + len(out.token_ids)}
    extra = {"tercel": tercel_stats([out])}
    if out.finish_reason == "stop":
        return head.body("completed", items.items, usage, completed_at=completed_at, **extra)
    reason = "max_output_tokens" if out.finish_reason == "length" else None
    return head.body("incomplete", items.items, usage, incomplete_details={"reason": reason}, **extra)


def failed_body(head: ResponseHead, items: OutputItems, error: dict) -> dict:
    """A stream whose request failed once under way: `error` is the chat route's error object."""
    code = "server_error" if error.get("type") == "server_error" else "invalid_prompt"
    return head.body("failed", items.items, error={"code": code, "message": error["message"]})
