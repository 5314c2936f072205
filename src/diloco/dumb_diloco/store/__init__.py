"""Where DumbDiLoCo files are kept: the `Transport` protocol, its stores (shared directory, Hub) and the Hub commit budget."""
