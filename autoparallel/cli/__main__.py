"""``python -m autoparallel.cli``: the same as the ``autoparallel`` command."""

import sys

from autoparallel.cli import main

sys.exit(main())
