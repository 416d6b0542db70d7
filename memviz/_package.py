"""Facts about the installed package, at the bottom of the house: its
version (the face, the CLI, the trace writer and the HTML report show it) and
its folder (so that memviz's own frames are told from the user's)."""

import os

__version__ = "0.1.0"

#: the memviz package's folder, absolute (memviz/, whatever file asks)
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
