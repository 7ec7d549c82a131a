"""Environments behind one small interface (`base.Environment`), one module per implementation."""
