import sys

from attend.cli import main

sys.exit(main())
