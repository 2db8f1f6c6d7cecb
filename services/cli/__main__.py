"""`python -m pcpstack.cli ...` is the `pcpstack` command (how the stack launcher starts services)."""

import sys

from pcpstack.cli.main import main

sys.exit(main())
