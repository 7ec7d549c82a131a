"""How every service is configured: the Settings base (one order of sources, every field on the command
line), the run-wide field types, the run binding, the device-claim settings and each recipe's defaults."""
