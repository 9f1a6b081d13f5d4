"""The worker service: the engine behind the OpenAI HTTP surface (`baton serve`).

    app.py           the FastAPI app, its lifespan (background model load), the public routes
    state.py         WorkerSettings (from the flags) and WorkerState (engine, pipeline, metrics)
    internal.py      /internal/prefill, /internal/release (prefill role), /internal/generate
    lifecycle.py     the server: SIGTERM drain, exit 1 when the engine loop dies
    pipeline.py      one OpenAI request: tokenise, jobs, admit, respond, disconnect watch
    serving.py       the engine side: jobs, admission (429), merged output batches, metrics
    openai_api.py    the formatting: SSE events and whole bodies, token events, TTFT parts
    logprobs.py      logprobs in OpenAI's two shapes
    tool_calls.py    tool calls in answers: forced ones from JSON, `auto` through tool_parsers/
    traces.py        the request's OpenTelemetry spans
    tuning.py        the tuning file's worker section, at start and on each reload
    registration.py  the worker's record, heartbeat and block events in the Redis registry

Imports go one way: app -> internal -> state -> pipeline -> openai_api -> serving -> the
engine's AsyncEngine facade; state builds serving, formatting and pipeline once the model
has loaded. Nothing here reaches past the facade into the engine's core.
"""
