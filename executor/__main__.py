"""meshplan executor: runs a plan JSON with torch.distributed (`torchrun ... -m meshplan.executor PLAN.json`)."""
import os
import sys

from meshplan.executor.cli import main
from meshplan.executor.metrics import PROFILER_USED

code = main()
if PROFILER_USED[0]:
    # The CPU memory probe ran the torch profiler; kineto's thread can abort the interpreter's teardown
    # after a finished run ("terminate called without an active exception", SIGABRT: pytorch/kineto#1051;
    # seen here about once in 30 runs). Everything is written and the process group destroyed by now,
    # so leave without the C++ static destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
