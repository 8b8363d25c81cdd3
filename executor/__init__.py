"""meshplan executor: runs a plan JSON with torch.distributed (`torchrun ... -m meshplan.executor PLAN.json`)."""
