"""``python -m kvpage.cli ...``: the ``kvpage`` console script, run from the source tree."""
import sys

from kvpage.cli import main

sys.exit(main())
