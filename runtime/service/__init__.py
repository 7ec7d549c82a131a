"""The service shell: what every spopp process around its own work has in common.

`logs` sets up logging (text or JSON lines, uvicorn's and warnings included), `routes` adds
/healthz, /readyz and /metrics to a FastAPI app, `prometheus` renders the text those metrics are
scraped as, and `server` runs uvicorn beside a service's own loop with a graceful SIGTERM or in
a thread. The tracker builds on it too, so nothing here imports more than the tracker's extra
holds (FastAPI, uvicorn, prometheus-client) and the core dependencies.
"""
