"""Run creation: `spopp init` creates a run at the tracker and loads its tasks and prior. The
deployment's init step (docker compose's `init` service, the Kubernetes init Job) runs it; `spopp
launch` creates its runs the same way, through the tracker's API."""
