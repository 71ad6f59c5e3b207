import sys

from rd2h.cli.main import main

sys.exit(main())
