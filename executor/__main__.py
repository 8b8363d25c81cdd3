"""meshplan executor: runs a plan JSON with torch.distributed (`torchrun ... -m meshplan.executor PLAN.json`)."""
import sys

from meshplan.executor.cli import main

sys.exit(main())
