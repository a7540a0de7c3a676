import sys

from kvshm.cli import main

sys.exit(main())
