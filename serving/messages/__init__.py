"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on the chat
route's machinery: a body is converted to the chat request the chat route validates and runs
(`convert.py`), its chat deltas become Anthropic's content blocks and events (`render.py`),
and its errors take Anthropic's shape (`errors.py`)."""
