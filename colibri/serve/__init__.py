"""`colibri serve`: an OpenAI- and Anthropic-compatible HTTP API on the one in-process Engine.

Layout: server.py (options, bind check, uvicorn with SIGTERM draining), app.py (FastAPI app, server
state, a generation's async side), openai_api.py and anthropic_api.py (the two wire formats),
scheduler.py (the thread that owns the Engine, the bounded FIFO queue, slot persistence),
schemas.py (strict pydantic request models), security.py (request id, Host allowlist, API key,
body limit), metrics.py (Prometheus), reasoning.py (the thinking switch).

Behaviour worth knowing:
- Endpoints: GET /v1/models, /v1/models/{id}; POST /v1/chat/completions, /v1/completions,
  /v1/messages, /v1/messages/count_tokens, /tokenize, /detokenize; GET /health, /metrics.
- Unknown fields and fields colibri does not implement (tools, images/audio, n > 1, penalties,
  logit_bias, response_format other than text, echo, suffix) are a 400 naming the field, in
  OpenAI's error envelope, or Anthropic's on /v1/messages. Harmless bookkeeping fields (user,
  metadata, store, service_tier, ...) are accepted and have no effect.
- max_tokens larger than --max-tokens is clamped, not refused; a prompt that does not fit the
  context is a 400 with code `context_length_exceeded`. Defaults follow the APIs: temperature 1,
  top_p 1; completions generate 16 tokens unless told otherwise.
- Extensions: `cache_slot` (which KV slot; default: the one holding the longest common prefix,
  else the least recently used), `top_k`, `seed` on /v1/messages, `enable_thinking`.
- Prefix reuse is reported as usage.prompt_tokens_details.cached_tokens (OpenAI) and
  usage.cache_read_input_tokens (Anthropic), and in the `x-colibri-prompt-tokens-reused` header;
  `x-colibri-kv-slot` names the slot, `x-colibri-queue-wait-ms` the wait for a turn.
- Thinking: with a chat template that has a switch (it reads `enable_thinking`), `enable_thinking`,
  `reasoning_effort` (anything but "none" turns it on) and Anthropic's `thinking` reach the
  template, and `<think>` text is served apart as `reasoning_content` / a `thinking` block.
  A template without a switch (SmolLM2's) cannot think: turning thinking off is accepted and
  changes nothing; turning it on is a 400 naming the field.
- KV slots are saved to the state directory (--state-dir, default under the colibri cache, keyed
  by the model's path) at every turn end, before the response ends, crash-safely; they are
  restored at start, so a conversation survives `kill -9`. A damaged file starts its slot empty.
- Admission: at most --max-queue requests wait (429 + Retry-After beyond it, or after
  --queue-timeout seconds of waiting); 503 while draining; all decided before any header is
  sent. A client that disconnects cancels its generation at the next token. SIGTERM or Ctrl-C
  drains (admitted requests finish, newcomers get 503) and exits 0; a second signal stops at once.
- Security: --api-key (Bearer or x-api-key, compared in constant time) guards every route but
  /health, which tells unauthenticated callers only {"status": "ok"}; a non-loopback --host needs
  a key or --allow-insecure-bind; Host headers must be localhost, the bound address (on 0.0.0.0:
  this machine's name and addresses) or an --allowed-host NAME (a DNS name pointing here, say);
  CORS only for the exact --cors-origin values; bodies are limited to 4 MiB and must arrive
  within --read-timeout; --max-connections caps concurrent connections (uvicorn answers 503
  beyond it). uvicorn has no deadline for the request line and headers themselves.
"""
