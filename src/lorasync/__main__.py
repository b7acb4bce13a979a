import sys

from lorasync.cli import main

sys.exit(main())
