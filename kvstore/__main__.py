"""``python -m kvstore``: the same dispatcher as the ``kvstore`` console script."""

import sys

from kvstore.cli.main import main

sys.exit(main())
