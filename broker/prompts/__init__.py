"""What the broker feeds: the built-in tasks, user datasets, and held-out evaluation rounds."""
