"""The OpenAI-compatible HTTP server (`loopserve serve`, extra `serve`: fastapi, uvicorn, jinja2).

Owns: the app, its protocol models, the serving logic, the engine process (the default,
`engine_process`) or the engine thread (`--no-engine-process`, `engine_thread`), metrics and
errors. Must not: be imported by `import loopserve` (the optional dependencies load only when
serving), or touch the `Engine` from the event loop (only the engine process does, or
`engine_thread.EngineThread`).

Request lifecycle: ASGI middlewares check the API key and the concurrency limit -> the handler
reads the body within its size limit (`body`) -> on a worker thread: the JSON is parsed within its
limits (`body`), validated into a protocol model (`protocol`), checked against the request limits
(`limits`), rendered with the chat template and tokenized, and the context length is checked
(`prompts`) -> `EngineLink.add` hands the engine requests over and resolves once the engine
accepted them -> outputs flow back into the request's asyncio queue -> they become one JSON
response or server-sent events -> a disconnect or the end of the response aborts whatever is
still running. Anything bad is a 4xx `OpenAIError` (`errors`) naming the field or the limit.
"""
