"""`python -m fedlm.cli` is the `fedlm` command."""

import sys

from fedlm.cli import main

sys.exit(main())
