"""The DumbDiLoCo master: its outer loop, its state and recovery, and its start."""
