"""What serving engines and users run after training: dflash-export, dflash-eval, dflash-regenerate and their generation loops. Never imports trainer.engine (tests/test_layout.py)."""
