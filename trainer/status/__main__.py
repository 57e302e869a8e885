"""`python -m trainer.status`: dflash-status (trainer/status/cli.py)."""

import sys

from trainer.status.cli import main

sys.exit(main())
