"""`python -m kiln.cli ...`: the same as the `kiln` command."""

from kiln.cli import main

raise SystemExit(main())
