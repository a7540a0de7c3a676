"""`python -m kvshm.workers`: the same as `kvshm run`."""

import sys

from kvshm.workers.run import main

sys.exit(main())
