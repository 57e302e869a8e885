"""`python -m trainer.lab.bench`: the benchmark's command line (run.py)."""

import sys

from trainer.optional import defer

defer()   # a program: torchao only when asked for (trainer/optional.py)

from trainer.lab.bench.run import main  # noqa: E402

sys.exit(main())
