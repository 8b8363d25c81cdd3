import sys

from meshplan.planner.cli import main

sys.exit(main())
