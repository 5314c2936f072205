"""One DumbDiLoCo node (master or worker): the `DumbDiLoCo` strategy and the parts it composes."""
