"""What a run leaves on shared storage, one layout each: snapshots and LoRA adapters, run records and
run folders, prior files, the model cache, provenance, and the JSON file helpers they share."""
