"""`python -m dreamstage.cli`."""
import sys

from dreamstage.cli import main

sys.exit(main())
