"""meshplan executor: runs a plan JSON with torch.distributed (`torchrun ... -m executor PLAN.json`)."""
