"""`python -m workers`: the same as `kvshm run`."""

import sys

from workers.run import main

sys.exit(main())
