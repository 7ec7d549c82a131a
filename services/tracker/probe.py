"""The tracker's container health check: `python3 -m services.tracker.probe` (docker-compose.yml).

Exit 0 when *this container's* tracker answers /readyz; 1, with why, otherwise. On the host network
a port that answers proves nothing: another program may hold it while the tracker fails to bind,
restarting again and again behind a healthy-looking container. So the answer must carry the
instance id that the tracker wrote to its instance file (SPOPP_TRACKER_INSTANCE_FILE) when it
started. Standard library only: it runs every few seconds.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path


def probe(url: str, instance_file: Path, timeout: float = 3.0) -> str | None:
    """None when the tracker that wrote `instance_file` answers `url`; else why not."""
    try:
        expected = instance_file.read_text().strip()
    except OSError:
        return f"no instance file {instance_file}: the tracker has not started (or not reached Redis)"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = json.loads(r.read(64 * 1024))
    except urllib.error.HTTPError as e:
        return f"{url} answered {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return f"{url} did not answer: {e}"
    found = body.get("instance") if isinstance(body, dict) else None
    if found != expected:
        return f"{url} is answered by another process (instance {found!r}, this tracker's is {expected!r})"
    return None


def main() -> int:
    port = os.environ.get("SPOPP_TRACKER_PORT", "8000")
    instance_file = Path(os.environ.get("SPOPP_TRACKER_INSTANCE_FILE", "/tmp/spopp-tracker-instance"))
    why = probe(f"http://127.0.0.1:{port}/readyz", instance_file)
    if why is not None:
        print(f"tracker probe: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
