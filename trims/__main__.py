import sys

from trims.cli import main

sys.exit(main())
