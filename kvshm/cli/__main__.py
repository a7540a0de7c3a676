"""`python -m kvshm.cli`: the same as `kvshm`."""

import sys

from kvshm.cli import main

sys.exit(main())
