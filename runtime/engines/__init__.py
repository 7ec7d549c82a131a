"""Generation engines behind one small interface (`base.Engine`), one module per implementation
(the transformers engine is a package: its scheduler, sampler and loaders are modules of their own)."""
