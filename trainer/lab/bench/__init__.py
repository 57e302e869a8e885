"""The pipeline benchmark, in rooms: run.py (the settings and variants, the stage and pipeline timings, the
serving figures, the results file and the command line: `python -m trainer.lab.bench`), shapes.py (the
random-init targets by shape, the synthetic data), flops.py (the model FLOPs and the peak), profile.py
(memory, kernel classes, compiles) and checks.py (the shape-cache probe, FlexAttention's parity on the GPU)."""
