import sys

from pipeshard.cli import main

sys.exit(main())
