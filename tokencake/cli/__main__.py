import sys

from tokencake.cli import main

sys.exit(main())
