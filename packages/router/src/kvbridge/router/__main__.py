"""``python -m kvbridge.router ...`` (the same as ``kvbridge router ...``)."""

import sys

from .cli import main

sys.exit(main())
