"""meshplan executor: runs a plan JSON with torch.distributed (`torchrun ... -m executor PLAN.json`)."""
import sys

from executor.cli import main

sys.exit(main())
