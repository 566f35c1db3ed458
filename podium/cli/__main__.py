"""``python -m podium.cli``: the same as the ``podium`` command."""

import sys

from podium.cli.main import main

sys.exit(main())
