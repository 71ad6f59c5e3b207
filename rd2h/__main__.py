import sys

from rd2h.app.cli import main

sys.exit(main())
