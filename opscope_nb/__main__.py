"""``python -m opscope_nb`` runs the ``opscope-nb`` command line."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
