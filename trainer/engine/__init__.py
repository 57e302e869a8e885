"""The training job: the loop, the warmup, the target and drafter stages, the feed, checkpoints, metrics, status reports and the in-training eval."""
