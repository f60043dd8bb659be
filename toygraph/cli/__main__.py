"""``python -m toygraph.cli``: the same as the ``toygraph`` command."""
import sys

from toygraph.cli.main import main

sys.exit(main())
