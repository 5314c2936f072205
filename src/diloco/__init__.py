"""Reproduction of OpenDiLoCo (arXiv 2407.07852): DDP, synchronous DiLoCo and asynchronous DumbDiLoCo."""
