"""``python -m podium.worker.host``: run one worker process (what the node agent starts)."""

import sys

# Run the importable module, not a __main__ copy: user code that imports
# podium.worker.host.process (current_host()) must see the running host's state.
from podium.worker.host import process

sys.exit(process.main())
