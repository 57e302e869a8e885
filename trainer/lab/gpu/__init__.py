"""Hand-run GPU measurements, each a script of its own, not run by the test suite (tests/ checks what of them
a CPU can: test_first_multi_gpu_run.py, test_dflash2_compare.py, test_old_drafter_baseline.py and others). Each writes its
results with bench.results_file (device, versions, commit) for results/.

    python trainer/lab/gpu/first_multi_gpu_run.py ...   # the first run on a fresh GPU machine
    python trainer/lab/gpu/regenerate_bench.py ...      # dflash-regenerate's captured decoder vs generate
    python trainer/lab/gpu/eval_bench.py ...            # dflash-eval's loops

and fp8_parity.py, dflash2_compare.py, old_drafter_baseline.py, split_attention.py, split2_compiled_probe.py
and warmup_recompiles.sh; each file's docstring says what it measures and how to run it.
"""
