"""Generation engines behind one small interface (`base.Engine`), one module per implementation."""
