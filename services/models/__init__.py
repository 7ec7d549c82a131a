"""Models a user brings: `spopp model import` (GGUF, or a package that ships one, to a Hugging Face folder)."""
