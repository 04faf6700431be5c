"""`python3 -m hwtune` is the `hwtune` command (daemon.cli), for a checkout that was never
pip-installed. Only this entry module, which nothing in the library imports, reaches into
daemon/; the hwtune/ library itself never does."""
import sys

from daemon.cli import main

sys.exit(main())
