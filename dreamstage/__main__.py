import sys

from dreamstage.cli import main

sys.exit(main())
