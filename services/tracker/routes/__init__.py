"""One router per resource of the tracker API."""
