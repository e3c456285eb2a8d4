"""``python -m whiteformer ...`` (and ``torchrun -m whiteformer train ...``): the ``whiteformer`` command."""
import sys

from whiteformer.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
