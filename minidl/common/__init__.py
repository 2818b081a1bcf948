"""Parameter initializers."""
