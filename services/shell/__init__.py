"""The service shell: what every spopp process around its own work has in common.

`logs` sets up logging (text or JSON lines, uvicorn's and warnings included), `routes` adds
/healthz, /readyz and /metrics to a FastAPI app, `prometheus` renders the text those metrics are
scraped as, `server` runs uvicorn beside a service's own loop with a graceful SIGTERM or in a
thread (`connections` and `http_settings` bound its connections), `middleware` holds the ASGI
layers every app shares (body limits, bearer-token auth, repeated JSON keys), and `child` starts a
service as a child process and waits until it answers. It sits at the services' level, beside
them, since it is process plumbing and no part of playing an episode (`runtime/`). The tracker
builds on it too, so nothing here imports more than the tracker's extra
holds (FastAPI, uvicorn, prometheus-client) and the core dependencies.
"""
