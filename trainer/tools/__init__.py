"""The shipped command-line tools beside the trainer: dflash-tiny (tiny.py), dflash-real (realmodel.py) and the
stream-order checker of a recorded run (streamcheck_cli.py). The team's instruments are trainer/lab/."""
