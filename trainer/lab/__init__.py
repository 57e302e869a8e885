"""The team's instruments, apart from what ships: the wheel the role installs leaves this package out
(pyproject.toml's packages.find), and nothing shipped imports it (tests/repo/test_layout.py). The benchmark
(bench/), the stream-order replay (opreplay.py), the recipe judged by tau (recipe.py), the slot probe
(slot_probe.py), the doc generators (results_index.py, contracts_tables.py) and the hand-run GPU
measurements (gpu/). They run from a checkout: `python -m trainer.lab.bench`, `python trainer/lab/gpu/...`."""
