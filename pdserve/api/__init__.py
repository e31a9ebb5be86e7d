"""The HTTP pieces the server and the PD router share, free of torch and of the engine: OpenAI error bodies and
exception handlers (errors.py), the API-key and body-limit guard (auth_and_body_limit.py), the OpenAI request
models (protocol.py, request_fields.py), server-sent events (sse.py) and the dashboard page (dashboard_page.py,
files in dashboard/)."""
