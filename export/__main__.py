import sys

from export.cli import main

sys.exit(main())
