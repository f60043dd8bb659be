"""The ``toygraph`` command line, on top of every other layer."""
from toygraph.cli.main import build_parser, main  # noqa: F401
