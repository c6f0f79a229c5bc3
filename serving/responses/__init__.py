"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`), built
on the chat route: a Responses body becomes the chat request it asks for (convert.py), which
the chat route's own checks, limits and engine submission run; the chat deltas of its one
choice become the Responses output items and events (render.py); stored responses, for
`previous_response_id` and `GET`, live in memory (store.py). docs/serving.md, "Responses API".
"""
