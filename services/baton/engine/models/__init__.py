"""Model definitions (our own torch modules) and weight loading."""
