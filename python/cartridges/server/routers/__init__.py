"""One router per resource; app.py mounts each under /api/v1 and /v1."""
