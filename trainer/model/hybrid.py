"""The hybrid-target names trainer/model/families.py now holds, under their old module for the two importers
not yet moved to it (trainer/serving/evaluate.py and trainer/serving/captured/); remove this module once they
import from families."""

from trainer.model.families import HybridTransformersTooOld, check_hybrid_transformers  # noqa: F401
