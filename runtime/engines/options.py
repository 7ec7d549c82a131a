"""engine_options as the services read them: which keys are theirs to give. Torch-free, so that
the settings modules import it at once.
"""

from __future__ import annotations

# engine_options keys that a service sets itself, from a field of its own: given in engine_options
# as well, one would silently win (or, passed twice, crash the process at start-up, again and again
# under supervision). Refused when the settings are read, with the field to use.
RESERVED_OPTIONS = {"lora_rank": "set the section's own lora_rank (spopp launch sets it to the learner's)"}


def check_engine_options(options: dict) -> dict:
    """`options` unless it sets a reserved key (ValueError naming the field to use instead)."""
    for key, use in RESERVED_OPTIONS.items():
        if key in options:
            raise ValueError(f"engine_options.{key} is not an engine option here: {use}")
    return options
