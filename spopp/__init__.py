"""spopp: asynchronous single-stream RL (SPO++ and SPO)."""

__version__ = "0.1.0"
